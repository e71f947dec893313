"""``conveyor serve MODEL`` as a new user types it: a GGUF file or a Hugging Face directory as the positional, the
flags vLLM and llama.cpp users know (--port, --host, --served-model-name, --max-model-len, --chat-template,
--strict-requests), ``make serve MODEL=... PORT=...``, the model's own context length as the default, and one line
naming the path when it is not a model."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from conveyor.bench.server import Server
from conveyor.config import ConfigError, ModelConfig, load_config
from tests.helpers import save_tiny_model_with_smollm2_vocab

REPO = Path(__file__).resolve().parent.parent

# a chat template of another form than the tiny model's tokenizer would have: the test renders it itself
TEMPLATE = ("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer) -> Path:
    """A Hugging Face directory made by transformers, with a 1,024-token context and no chat template."""
    path = tmp_path_factory.mktemp("tiny-hf")
    save_tiny_model_with_smollm2_vocab(path, tokenizer, max_position_embeddings=1024)
    (path / "tokenizer_config.json").unlink()  # (the helper writes a chat template there)
    return path


@pytest.mark.parametrize("make", [False, True], ids=["conveyor-serve-dir", "make-serve-gguf"])
def test_a_model_path_and_a_port_serve_it(make, tiny_dir, smollm2_path, tmp_path):
    """`conveyor serve DIR --port P` and `make serve MODEL=FILE PORT=P`: the positional is the model, the port is
    where it listens, and a chat request is answered; the directory's 1,024-token context is the default length."""
    port = _free_port()
    if make:
        command = ["make", "-s", "-C", str(REPO), "serve", f"MODEL={smollm2_path}", f"PORT={port}"]
    else:
        command = [sys.executable, "-m", "conveyor", "serve", str(tiny_dir), "--port", str(port),
                   "--chat-template", TEMPLATE]
    server = Server("", tmp_path, command=command).start()
    try:
        assert server.http == f"http://127.0.0.1:{port}"
        with openai.OpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            name = client.models.list().data[0].id
            reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
        models = httpx.get(f"{server.http}/v1/models").json()["data"]
        if make:
            assert name == smollm2_path.stem
        else:
            assert name == tiny_dir.name
            assert models[0]["max_model_len"] == 1024
            assert "max_model_len 1024: the model's context length" in server.output
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny_server(tiny_dir, tmp_path_factory):
    """The tiny directory served with a chat template, two names and strict requests."""
    command = [sys.executable, "-m", "conveyor", "serve", str(tiny_dir), "--port", "0", "--chat-template", TEMPLATE,
               "--served-model-name", "tiny", "tiny-alias", "--strict-requests"]
    server = Server("", tmp_path_factory.mktemp("tiny-server"), command=command).start()
    yield server
    server.stop()


def test_a_chat_template_of_the_config_serves_a_model_without_one(tiny_server, tokenizer):
    """The prompt the model reads is the configured template rendered (counted by an independent render)."""
    import jinja2

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    with openai.OpenAI(base_url=f"{tiny_server.http}/v1", api_key="unused", max_retries=0) as client:
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    rendered = jinja2.Template(TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(tokenizer.hf.encode(rendered, add_special_tokens=False).ids)


def test_served_model_names_are_the_name_and_its_aliases(tiny_server):
    with openai.OpenAI(base_url=f"{tiny_server.http}/v1", api_key="unused", max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
        reply = client.completions.create(model="tiny-alias", prompt="Hello", max_tokens=2)
        assert reply.model == "tiny-alias" and reply.usage.completion_tokens >= 1  # (served, the name echoed)
        with pytest.raises(openai.NotFoundError, match="'tiny', 'tiny-alias'"):
            client.completions.create(model="other", prompt="Hello", max_tokens=2)


def test_strict_requests_refuses_an_unknown_field_by_name(tiny_server):
    body = {"model": "tiny", "prompt": "Hello", "max_tokns": 5}
    response = httpx.post(f"{tiny_server.http}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokns" and "max_tokns" in error["message"]
    assert tiny_server.metric("conveyor_request_unknown_fields_total", field="max_tokns") >= 1


def test_an_unknown_field_is_logged_once_and_counted(default_server):
    """Without strict requests, `max_tokns` is served (as if absent), logged once by name, and counted each time."""
    def count() -> float:
        try:
            return default_server.metric("conveyor_request_unknown_fields_total", field="max_tokns")
        except KeyError:
            return 0.0

    before = count()
    for _ in range(2):
        body = {"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 1, "max_tokns": 5}
        assert httpx.post(f"{default_server.http}/v1/completions", json=body, timeout=60).status_code == 200
    assert count() == before + 2
    warnings = [line for line in default_server.lines if "'max_tokns'" in line]
    assert len(warnings) == 1 and "ignored" in warnings[0], warnings


def test_a_missing_required_field_is_named(default_server):
    response = httpx.post(f"{default_server.http}/v1/chat/completions", json={"model": "smollm2-135m-instruct"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_the_root_leads_to_the_dashboard_and_the_banner_prints_its_address(default_server):
    response = httpx.get(f"{default_server.http}/", follow_redirects=False)
    assert response.status_code == 307 and response.headers["location"] == "/dashboard"
    assert f"Dashboard: {default_server.http}/dashboard" in default_server.output


@pytest.mark.parametrize("make_path, expected", [
    (lambda tmp: tmp / "x.gguf", "no such file or directory; expected a .gguf file"),
    (lambda tmp: (tmp / "x.gguf").write_text("not a model") and tmp / "x.gguf", "not a GGUF file"),
    (lambda tmp: tmp, "the directory has no config.json; expected a Hugging Face model directory"),
], ids=["missing", "not-gguf", "no-config-json"])
def test_a_path_that_is_no_model_is_one_line_naming_it(make_path, expected, tmp_path):
    path = make_path(tmp_path)
    result = subprocess.run([sys.executable, "-m", "conveyor", "serve", str(path), "--port", "0"], check=False,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: ") and expected in lines[0], result.stderr


def test_shortcuts_are_the_keys_they_stand_for():
    from conveyor.entrypoints.cli import _config_and_overrides, build_parser

    args = build_parser().parse_args(["serve", "configs/default.toml", "--port", "8123", "--host", "0.0.0.0",
                                      "--max-model-len", "512", "--served-model-name", "a", "b", "c"])
    path, overrides = _config_and_overrides(args)
    config = load_config(path, overrides)
    http = config.transport[0].options
    assert (http.port, http.host, http.strict_requests) == (8123, "0.0.0.0", False)
    assert (config.model.max_model_len, config.model.name, config.model.aliases) == (512, "a", ["b", "c"])


def test_a_transport_is_named_by_its_plugin_in_overrides(tmp_path):
    path = tmp_path / "two.toml"
    path.write_text('[[transport]]\nplugin = "zmq"\n\n[[transport]]\nplugin = "http"\nport = 0\n')
    config = load_config(path, {"transport.http.port": 8124})
    assert [spec.options.port for spec in config.transport if spec.plugin == "http"] == [8124]
    with pytest.raises(ConfigError, match=r"transport has 2 entries: 0 \(zmq\), 1 \(http\); name one by index or "
                       "by plugin"):
        load_config(path, {"transport.2.port": 1})
    with pytest.raises(ConfigError, match=r"needs plugin = \"name\"; installed: .*http"):
        (tmp_path / "bare.toml").write_text("[[transport]]\nport = 1\n")
        load_config(tmp_path / "bare.toml")


def test_a_bad_model_path_override_is_blamed_on_the_override(tmp_path):
    from conveyor.model.tokenizer import load_tokenizer

    config = load_config(REPO / "configs" / "default.toml", {"model.path": str(tmp_path / "nope.gguf")})
    with pytest.raises(ConfigError, match=r"default.toml with --set model.path: \[model\] path"):
        load_tokenizer(config.model, config.source_of("model"))


def test_chat_template_is_a_file_or_the_template_itself(tiny_dir, tmp_path):
    from conveyor.model.tokenizer import load_tokenizer

    assert load_tokenizer(ModelConfig(path=str(tiny_dir))).chat_template is None
    assert load_tokenizer(ModelConfig(path=str(tiny_dir), chat_template=TEMPLATE)).chat_template == TEMPLATE
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    from_file = load_tokenizer(ModelConfig(path=str(tiny_dir), chat_template=str(tmp_path / "t.jinja")))
    assert from_file.apply_chat_template([{"role": "user", "content": "x"}]) == "[USER] x\n[ASSISTANT] "
    with pytest.raises(ConfigError, match=r"\[model\] chat_template = .*expected a Jinja template file"):
        load_tokenizer(ModelConfig(path=str(tiny_dir), chat_template=str(tmp_path / "missing.jinja")))
    with pytest.raises(ConfigError, match="not a valid Jinja template: line 1"):
        load_tokenizer(ModelConfig(path=str(tiny_dir), chat_template="{% for m in messages %}"))


def test_the_default_length_is_capped_at_what_the_kv_cache_holds(tiny_dir):
    """max_model_len = 0 with a cache of 16 blocks of 16 tokens: 256, not the model's 1,024, and the banner's
    note says why; a length set in the config is kept."""
    from conveyor import LLM

    overrides = {"model.path": str(tiny_dir), "model.dtype": "float32", "kvcache.num_blocks": 16,
                 "kvcache.block_size": 16}
    with LLM(overrides=overrides) as llm:
        ready = llm.engine.ready(0.0)
        assert llm.engine.max_model_len == ready.max_model_len == 256
        assert "context length 1024 capped at the 256 tokens" in ready.max_model_len_note
        assert llm.engine.kvcache.layout.spec.max_model_len == 256
    with LLM(overrides={**overrides, "model.max_model_len": 128}) as llm:
        assert llm.engine.max_model_len == 128 and llm.engine.ready(0.0).max_model_len_note == "[model] max_model_len"


@pytest.mark.parametrize("method, expected", [
    ("auto", ""),
    ("int8", "the file is quantized already (Q4_1 (5.0 bits a weight)"),
    ("int4", "its blocks are served as stored; quant 'int4' changes only weights stored as floats"),
    ("none", "quant 'none' expands its blocks to torch.bfloat16"),
])
def test_requantizing_a_quantized_file_is_said(method, expected, smollm2_path):
    import torch

    from conveyor.config import PluginSpec
    from conveyor.model.checkpoint import open_checkpoint
    from conveyor.model.loader import requantize_note
    from conveyor.registry import PluginRegistry

    registry = PluginRegistry()
    options = registry.get("quant", method).Options()
    quant = registry.build("quant", PluginSpec(method, options), torch.bfloat16, torch.device("cpu"))
    note = requantize_note(open_checkpoint(smollm2_path), quant)
    assert (note == "") if not expected else (expected in note), note
    if method == "int8":
        assert "quant.plugin = 'auto' serves them as stored" in note


def test_the_config_reference_names_the_shortcuts():
    text = (REPO / "docs" / "configuration.md").read_text()
    for flag in ("--port", "--host", "--served-model-name", "--max-model-len", "--chat-template", "--strict-requests"):
        assert flag in text, flag
