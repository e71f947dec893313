"""Structured output: JSON schemas, JSON objects, regexes, choices and grammars constrain SmolLM2's output
(validated with ``jsonschema`` and ``re``, independent of the grammar engine); bad languages are 400s; the
OpenAI client's ``response_format`` works through the real server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch

from conveyor.messages import EngineRequest
from conveyor.sampling import SamplingParams, StructuredOutput

SCHEMAS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())


def ask(name: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give an example of a {name} as JSON."}]


def test_thirty_schemas_give_json_that_validates_greedy_and_sampled(llm_fp32):
    """30 schemas from one boolean to nested objects with bounded arrays, enums, patterns, anyOf and $refs,
    each greedy and sampled (temperature 1), all 60 at once: every output parses, validates against its
    schema, and ends on the model's stop token (never cut by max_tokens)."""
    params = [SamplingParams(max_tokens=400, temperature=temperature, seed=11,
                             structured=StructuredOutput(json=json.dumps(s["schema"])))
              for temperature in (0.0, 1.0) for s in SCHEMAS]
    outputs = llm_fp32.generate([ask(s["name"]) for s in SCHEMAS] * 2, params)
    for schema, output in zip(SCHEMAS * 2, outputs):
        assert output.finish_reason == "stop", (schema["name"], output.text)
        jsonschema.validate(json.loads(output.text), schema["schema"])


def test_regex_choice_grammar_and_json_object_beside_a_plain_request(llm_fp32):
    grammar = 'root ::= "(" expr ")"\nexpr ::= num (("+" | "*") num)*\nnum ::= [1-9] [0-9]?'
    specs = {
        "regex": StructuredOutput(regex=r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}"),
        "choice": StructuredOutput(choice=["Paris", "London", "Berlin"]),
        "grammar": StructuredOutput(grammar=grammar),
        "json_object": StructuredOutput(json_object=True),
    }
    prompts = ["Who is 42?", "The capital of France is", "Write an arithmetic expression.", "A JSON object:"]
    plain = [{"role": "user", "content": "Name a color."}]
    outputs = llm_fp32.generate(
        [[{"role": "user", "content": p}] for p in prompts] + [plain],
        [SamplingParams(max_tokens=300, temperature=0.0, structured=s) for s in specs.values()]
        + [SamplingParams(max_tokens=20, temperature=0.0)],
    )
    # a request without a grammar in the same batch is not constrained
    assert outputs.pop().token_ids == llm_fp32.generate(plain, SamplingParams(max_tokens=20, temperature=0.0))[0].token_ids
    texts = dict(zip(specs, (o.text for o in outputs)))
    assert re.fullmatch(r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}", texts["regex"]), texts
    assert texts["choice"] in ("Paris", "London", "Berlin"), texts
    assert re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)", texts["grammar"]), texts
    assert isinstance(json.loads(texts["json_object"]), dict), texts
    assert all(o.finish_reason == "stop" for o in outputs)


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutput(json='{"type": "object", "properties": {"a": {"type": "strin"}}}'), "JSON schema"),
        (StructuredOutput(json="{not json"), "not valid JSON"),
        (StructuredOutput(regex="([a-z]"), "regex"),
        (StructuredOutput(grammar="root ::= missing_rule"), "grammar"),
    ],
    ids=["bad-type", "bad-json", "bad-regex", "bad-grammar"],
)
def test_a_language_that_does_not_compile_is_refused_before_it_runs(llm_fp32, spec, message):
    with pytest.raises(ValueError, match=message):
        llm_fp32.generate("Hi", SamplingParams(max_tokens=4, structured=spec))


def test_structured_output_takes_exactly_one_language():
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice, grammar; got regex, "
                                         "choice"):
        StructuredOutput(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="got none"):
        StructuredOutput()


def test_an_abort_while_the_grammar_compiles_ends_the_request_and_leaks_nothing(llm_fp32):
    core = llm_fp32.engine
    params = SamplingParams(max_tokens=8, structured=StructuredOutput(json=json.dumps(SCHEMAS[-1]["schema"])))
    try:
        assert core.add_request(EngineRequest("compiling", [1, 2, 3], params)) is None
        assert "compiling" in core.grammars.compiling
        [output] = core.abort(["compiling"])
        assert output.finish_reason == "abort"
        assert not core.grammars.compiling and not core.has_unfinished()
        assert core.kvcache.num_free_blocks == core.kvcache.num_blocks
    finally:  # (the engine is shared: a failure above leaves nothing behind for the next test)
        core.abort(["compiling"])


def test_the_same_schema_compiles_once(llm_fp32):
    """Two requests with one schema, one after the other: the grammar cache grows with the first and not with
    the second, which takes the compiled grammar from it."""
    grammars = llm_fp32.engine.grammars
    question = ask("count")
    llm_fp32.generate(question, SamplingParams(max_tokens=2, structured=StructuredOutput(choice=["a", "b"])))
    compiler = grammars.grammars.compiler  # (set up by the request above)
    schema = {"type": "object", "properties": {"compiled_once": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["compiled_once"], "additionalProperties": False}
    params = SamplingParams(max_tokens=30, temperature=0, structured=StructuredOutput(json=json.dumps(schema)))
    sizes = [compiler.get_cache_size_bytes()]
    for _ in range(2):
        [output] = llm_fp32.generate(question, params)
        jsonschema.validate(json.loads(output.text), schema)
        sizes.append(compiler.get_cache_size_bytes())
    assert sizes[1] > sizes[0], sizes  # compiled and kept
    assert sizes[2] == sizes[1], sizes  # found, not compiled again


def test_the_sampler_draws_only_what_the_bitmask_allows():
    from conveyor.messages import ScheduledRequest
    from conveyor.worker.sampler import Sampler

    vocab = 100
    logits = torch.randn(3, vocab)
    allowed = torch.zeros(2, (vocab + 31) // 32, dtype=torch.int32)
    allowed[0, 70 // 32] = 1 << (70 % 32)  # row 0: token 70 only
    allowed[1, 0] = 0b1010  # row 2: tokens 1 and 3
    requests = [ScheduledRequest(f"r{i}", 0, [0], [0], SamplingParams(temperature=t, logprobs=0))
                for i, t in enumerate((0.0, 0.0, 1.0))]
    expected_free = int(logits[1].argmax())
    for _ in range(20):
        tokens, entries = Sampler().sample(logits.clone(), requests, ([0, 2], allowed))
        assert tokens[0] == 70 and tokens[1] == expected_free and tokens[2] in (1, 3)
        # logprobs describe the model's distribution, before the mask
        assert entries[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[70]), abs=1e-5)


def test_openai_response_format_through_the_server(openai_client):
    schema = SCHEMAS[26]["schema"]  # a tool call's shape
    client = openai_client
    model = client.models.list().data[0].id
    response_format = {"type": "json_schema", "json_schema": {"name": "call", "schema": schema, "strict": True}}
    reply = client.chat.completions.create(model=model, messages=ask("weather tool call"), max_tokens=200,
                                           temperature=0, response_format=response_format)
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    stream = client.chat.completions.create(model=model, messages=ask("weather tool call"), max_tokens=200,
                                            temperature=0, response_format=response_format, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=model, messages=ask("x"), max_tokens=10,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
        )
    assert "JSON schema" in bad.value.body["message"] and bad.value.body["param"] == "response_format"
    # vLLM's fields; two at once is a 400
    body = {"model": model, "prompt": "Pick one:", "max_tokens": 5, "temperature": 0,
            "structured_outputs": {"choice": ["yes", "no"]}}
    url = f"{client.base_url}completions"
    text = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    assert text in ("yes", "no")
    body["guided_regex"] = "[0-9]+"
    response = httpx.post(url, json=body, timeout=60)
    assert response.status_code == 400 and "asked for twice" in response.json()["error"]["message"]


# vLLM's older fields and OpenAI's json_object, each with what it asks for, checked independently of the grammar
ARITHMETIC = 'root ::= "(" expr ")"\nexpr ::= num (("+" | "*") num)*\nnum ::= [1-9] [0-9]?'
ARITHMETIC_RE = r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}
WHO_RE = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}"


def test_guided_fields_and_json_object_through_the_server(openai_client):
    """guided_regex, guided_choice, guided_grammar, guided_json (a schema as an object) and response_format
    json_object, sent at once through the openai client: each reply is in its language and ends on the model's
    stop token."""
    from concurrent.futures import ThreadPoolExecutor

    client = openai_client
    model = client.models.list().data[0].id
    cases = {
        "guided_regex": ("Who is 42?", {"extra_body": {"guided_regex": WHO_RE}}),
        "guided_choice": ("The capital of France is", {"extra_body": {"guided_choice": ["Paris", "London", "Berlin"]}}),
        "guided_grammar": ("Write an arithmetic expression.", {"extra_body": {"guided_grammar": ARITHMETIC}}),
        "guided_json": ("Give an example of a city as JSON.", {"extra_body": {"guided_json": CITY}}),
        "json_object": ('Give the JSON object {"ok": true}.', {"response_format": {"type": "json_object"}}),
    }

    def reply(case: str):
        content, fields = cases[case]
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                              max_tokens=60, temperature=0, **fields).choices[0]

    with ThreadPoolExecutor(len(cases)) as pool:
        choices = dict(zip(cases, pool.map(reply, cases)))
    for case, choice in choices.items():
        assert choice.finish_reason == "stop", (case, choice.message.content)
    texts = {case: choice.message.content for case, choice in choices.items()}
    assert re.fullmatch(WHO_RE, texts["guided_regex"]), texts
    assert texts["guided_choice"] in ("Paris", "London", "Berlin"), texts
    assert re.fullmatch(ARITHMETIC_RE, texts["guided_grammar"]), texts
    jsonschema.validate(json.loads(texts["guided_json"]), CITY)
    assert isinstance(json.loads(texts["json_object"]), dict), texts


@pytest.mark.parametrize(
    "field, value, words",
    [("guided_regex", "([a-z]", "the regex cannot be compiled"),
     ("guided_grammar", "root ::= missing_rule", "the grammar cannot be compiled"),
     ("structured_outputs", {"regex": "[0-9]{3"}, "the regex cannot be compiled")],
    ids=["bad-regex", "bad-grammar", "bad-regex-in-structured-outputs"],
)
def test_a_regex_or_grammar_that_does_not_compile_is_a_400_naming_it(default_server, field, value, words):
    """OpenAI's JSON error saying what does not compile and naming the field, streamed or not: the engine's
    compile refuses it before it runs (the only parse it gets), and a stream's status waits for that, so it is a
    400 there too, not an error event after a 200. Refused, not counted as a request that ended in an error."""
    errors = default_server.num_finished("error")
    for stream in (False, True):
        body = {"prompt": "Hi", "max_tokens": 4, field: value, "stream": stream}
        response = httpx.post(f"{default_server.http}/v1/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert response.headers["content-type"].startswith("application/json")
        error = response.json()["error"]
        assert words in error["message"] and error["code"] == 400 and error["param"] == field, error
    assert default_server.num_finished("error") == errors


@pytest.fixture(scope="module")
def zmq_server(tmp_path_factory):
    """The default model served over the ZMQ transport alone."""
    from tests.server import Server

    config = '[server]\nstatus_interval = 0\n\n[[transport]]\nplugin = "zmq"\naddress = "tcp://127.0.0.1:*"\n'
    server = Server(config, tmp_path_factory.mktemp("structured_zmq")).start()
    yield server
    assert server.stop() == 0, server.output


def test_structured_output_over_zmq(zmq_server):
    """``params.structured`` as docs/zmq-protocol.md writes it (a map with one language; a schema as JSON text),
    five languages and two that do not compile sent at once on one socket: each reply is in its language, each
    bad one an ``error`` with status 400 naming what does not compile. (The server lists no HTTP table: its
    banner says that it serves no HTTP.)"""
    import msgspec
    import zmq

    assert "No HTTP: the config's [[transport]] tables replace the default one" in zmq_server.output

    requests = {
        "regex": ("Who is 42?", {"regex": WHO_RE}),
        "choice": ("The capital of France is", {"choice": ["Paris", "London", "Berlin"]}),
        "grammar": ("Write an arithmetic expression.", {"grammar": ARITHMETIC}),
        "json": ("Give an example of a city as JSON.", {"json": json.dumps(CITY)}),
        "json_object": ('Give the JSON object {"ok": true}.', {"json_object": True}),
        "bad-regex": ("Hi", {"regex": "([a-z]"}),
        "bad-grammar": ("Hi", {"grammar": "root ::= missing_rule"}),
    }
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(zmq_server.url("tcp"))
    try:
        for rid, (content, structured) in requests.items():
            message = {"request_id": rid, "messages": [{"role": "user", "content": content}], "stream": False,
                       "params": {"max_tokens": 60, "temperature": 0, "structured": structured}}
            socket.send_multipart([b"generate", msgspec.msgpack.encode(message)])
        replies = {}
        while len(replies) < len(requests):
            assert socket.poll(120_000), f"no reply; have {sorted(replies)}"
            kind, body = socket.recv_multipart()
            message = msgspec.msgpack.decode(body)
            assert message["request_id"] not in replies, (kind, message)  # (one reply each: stream is false)
            replies[message["request_id"]] = (kind, message)
    finally:
        socket.close()
    for rid in ("regex", "choice", "grammar", "json", "json_object"):
        kind, message = replies[rid]
        assert kind == b"chunk" and message["finish_reason"] == "stop", (rid, message)
    texts = {rid: message["text"] for rid, (kind, message) in replies.items() if kind == b"chunk"}
    assert re.fullmatch(WHO_RE, texts["regex"]), texts
    assert texts["choice"] in ("Paris", "London", "Berlin"), texts
    assert re.fullmatch(ARITHMETIC_RE, texts["grammar"]), texts
    jsonschema.validate(json.loads(texts["json"]), CITY)
    assert isinstance(json.loads(texts["json_object"]), dict), texts
    for rid, words in [("bad-regex", "the regex cannot be compiled"), ("bad-grammar", "the grammar cannot be compiled")]:
        kind, error = replies[rid]
        assert kind == b"error" and error["status"] == 400 and words in error["message"], error


CITY_POPULATION = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                                     "population": {"type": "integer"}},
                   "required": ["name", "country", "population"]}
POPULATION_PROMPT = [{"role": "user", "content": "Give the name, country and exact population of New York as JSON."}]


def test_an_answer_is_closed_within_max_tokens_and_parses(llm_fp32):
    """An unbounded integer and strings, which SmolLM2 runs on until max_tokens (e.g. a population of ever more
    digits): greedy and sampled with max_tokens 64, and the 30 schemas at a budget a third of their usual
    length wherever their shortest answer fits it: every answer parses and validates (jsonschema)."""
    schema = StructuredOutput(json=json.dumps(CITY_POPULATION))
    params = [SamplingParams(max_tokens=64, temperature=t, seed=seed, structured=schema)
              for t, seed in [(0.0, None)] + [(1.0, s) for s in range(6)]]
    outputs = llm_fp32.generate([POPULATION_PROMPT] * len(params), params)
    for output in outputs:
        assert len(output.token_ids) <= 64
        jsonschema.validate(json.loads(output.text), CITY_POPULATION)
    grammars = llm_fp32.engine.grammars.grammars
    fitting, budgets = [], []
    for s in SCHEMAS:
        shortest = grammars.closing(grammars.matcher(grammars.compile(StructuredOutput(json=json.dumps(s["schema"])))))
        budget = max(8, len(shortest) + 1)
        if budget <= 48:
            fitting.append(s)
            budgets.append(budget + 6)
    assert len(fitting) >= 20
    params = [SamplingParams(max_tokens=b, temperature=1.0, seed=3, structured=StructuredOutput(json=json.dumps(
        s["schema"]))) for s, b in zip(fitting, budgets)]
    for s, output in zip(fitting, llm_fp32.generate([ask(s["name"]) for s in fitting], params)):
        jsonschema.validate(json.loads(output.text), s["schema"])


def test_a_closed_answer_says_so(openai_client):
    """The chat completion of an answer closed to fit max_tokens carries grammar_closed: true, and ends by length;
    one that completed by itself ends by stop."""
    for seed in range(8):
        reply = openai_client.chat.completions.create(
            model="smollm2-135m-instruct", messages=POPULATION_PROMPT, max_tokens=20, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_POPULATION}})
        choice = reply.choices[0]
        jsonschema.validate(json.loads(choice.message.content), CITY_POPULATION)
        if (choice.model_extra or {}).get("grammar_closed"):
            # (the budget ended it: a client's check for a cut-off answer, the openai package's parse(), sees one)
            assert reply.usage.completion_tokens <= 20 and choice.finish_reason == "length"
            return
        assert choice.finish_reason == "stop"
    pytest.fail("no answer of 20 tokens needed closing")


def test_an_answer_cut_off_before_its_closing_fits_does_not_say_closed(openai_client):
    """At max_tokens 5 the schema's answer cannot complete (its shortest closing is longer): the choice ends by
    length, its text does not parse, and it does not claim grammar_closed."""
    for max_tokens in (2, 5):
        reply = openai_client.chat.completions.create(
            model="smollm2-135m-instruct", messages=POPULATION_PROMPT, max_tokens=max_tokens, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_POPULATION}})
        choice = reply.choices[0]
        assert choice.finish_reason == "length"
        with pytest.raises(json.JSONDecodeError):
            json.loads(choice.message.content)
        assert not (choice.model_extra or {}).get("grammar_closed")
