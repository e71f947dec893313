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
    assert core.add_request(EngineRequest("compiling", [1, 2, 3], params)) is None
    assert "compiling" in core.grammars.compiling
    [output] = core.abort(["compiling"])
    assert output.finish_reason == "abort"
    assert not core.grammars.compiling and not core.has_unfinished()
    assert core.kvcache.num_free_blocks == core.kvcache.num_blocks


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
