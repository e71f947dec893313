"""The frontend process without torch: run as a script (``python tests/torchless_frontend.py``), it makes torch
and triton unimportable, loads what ``conveyor serve`` loads in the frontend process (the command line, the server,
every built-in plugin, the tokenizer), and serves requests of every API through the HTTP transport over a stand-in
engine client, checking each answer. It prints the modules that tried to import torch (none, when it passes)."""

from __future__ import annotations

import importlib.abc
import sys
import traceback

BLOCKED = ("torch", "triton")
attempts: list[str] = []


class Blocker(importlib.abc.MetaPathFinder):
    """Refuses torch and triton, noting who asked (a module that catches the ImportError is still noted)."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            callers = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()[:-1] if "conveyor" in f.filename
                       or "/core/" in f.filename or "/plugins/" in f.filename]
            attempts.append(f"{name} <- {callers[-1] if callers else '?'}")
            raise ImportError(f"{name} is blocked: the frontend process must not import it")


sys.meta_path.insert(0, Blocker())

# (imported after the blocker, so that nothing below loads torch unseen)
import base64
import json
import struct

import anyio
import httpx

from conveyor.entrypoints.cli import build_parser
from conveyor.config import load_config
from conveyor.engine.client import EngineClient
from conveyor.messages import EngineReady, EngineRequest, RequestOutput
from conveyor.model.tokenizer import load_tokenizer
from conveyor.registry import PluginRegistry
from conveyor.serving.frontend import EngineFrontend
from conveyor.serving.server import _metrics

EMBEDDING = (0.5, -1.0, 2.0, 0.25)


class StandInEngine(EngineClient):
    """An engine client without an engine: each request's output is its prompt's first tokens, one a step, until
    max_tokens (finish reason "length"); a pooling request gets EMBEDDING."""

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        ready = EngineReady(1, 2048, 100, 16, 3.0, 0.1)
        self._ready(ready)
        task_status.started(ready)
        await anyio.sleep_forever()

    async def shutdown(self, timeout: float = 10.0) -> None:
        pass

    def _submit(self, request: EngineRequest) -> None:
        rid, params = request.request_id, request.params
        if params.pooling:
            self._publish([RequestOutput(rid, finish_reason="stop", num_prompt_tokens=len(request.prompt_token_ids),
                                         embedding=struct.pack("<4f", *EMBEDDING))], None)
            return
        tokens = answer(request.prompt_token_ids, params.max_tokens)
        outputs = [RequestOutput(rid, [token], num_prompt_tokens=len(request.prompt_token_ids)) for token in tokens]
        outputs[-1].finish_reason = "length"
        self._publish(outputs, None)

    def _abort(self, request_ids: list[str], at_stop_string: bool = False) -> None:
        self._publish([RequestOutput(r, finish_reason="stop" if at_stop_string else "abort") for r in request_ids],
                      None)


def answer(prompt_ids: list[int], max_tokens: int | None) -> list[int]:
    return (prompt_ids * 8)[: max_tokens or 4]


async def serve_requests() -> None:
    build_parser()  # (conveyor serve builds every command's flags)
    config = load_config(None, None)
    registry = PluginRegistry.of(config)
    transport = registry.build("transport", config.transport[0])
    tokenizer = load_tokenizer(config.model, source=config.source_of("model"))
    engine = StandInEngine()
    name = config.model.served_name
    frontend = EngineFrontend(engine, tokenizer, name, _metrics(engine, name), config.lora,
                              config.model.reasoning_parser, config.model.pooling, config.scheduler,
                              registry.get("scheduler", config.scheduler.plugin), config.model.aliases)
    chat = [{"role": "user", "content": "Name three rivers."}]
    text = "The river runs to the sea"
    expected_text = tokenizer.decode(answer(tokenizer.encode(text), 4))
    expected_chat = tokenizer.decode(answer(frontend.encode_chat(chat), 4))
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=transport.app(frontend)), base_url="http://frontend")
        async with http:
            async def post(path: str, body: dict) -> dict:
                reply = await http.post(path, json={"model": name, **body})
                assert reply.status_code == 200, (path, reply.status_code, reply.text)
                return reply.json()

            completion = await post("/v1/completions", {"prompt": text, "max_tokens": 4})
            assert completion["choices"][0]["text"] == expected_text, completion
            reply = await post("/v1/chat/completions", {"messages": chat, "max_tokens": 4})
            assert reply["choices"][0]["message"]["content"] == expected_chat, reply
            async with http.stream("POST", "/v1/chat/completions", json={
                    "model": name, "messages": chat, "max_tokens": 4, "stream": True}) as stream:
                events = [line[6:] async for line in stream.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            deltas = [json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                      if json.loads(e)["choices"]]
            assert "".join(deltas) == expected_chat, deltas
            tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
            reply = await post("/v1/chat/completions", {"messages": chat, "max_tokens": 4, "tools": tools})
            assert reply["choices"][0]["message"]["content"] == expected_chat, reply
            reply = await post("/v1/responses", {"input": chat, "max_output_tokens": 4})
            assert reply["output"][0]["content"][0]["text"] == expected_chat, reply
            reply = await post("/v1/messages", {"messages": chat, "max_tokens": 4})
            assert reply["content"][0]["text"] == expected_chat and reply["stop_reason"] == "max_tokens", reply
            reply = await post("/v1/embeddings", {"input": text, "encoding_format": "base64"})
            vector = struct.unpack("<4f", base64.b64decode(reply["data"][0]["embedding"]))
            norm = sum(v * v for v in EMBEDDING) ** 0.5
            assert all(abs(got - v / norm) < 1e-6 for got, v in zip(vector, EMBEDDING)), vector
            reply = await post("/tokenize", {"prompt": text})
            assert reply["tokens"] == tokenizer.encode(text), reply
            metrics = await http.get("/metrics")
            assert metrics.status_code == 200 and "conveyor" in metrics.text
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    anyio.run(serve_requests)
    print("\n".join(attempts))
    sys.exit(1 if attempts else 0)
