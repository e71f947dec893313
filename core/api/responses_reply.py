"""The Response object of one Responses API call (``conveyor.api.responses_api``): its output
items, and, streamed, the typed events that build them (``response.created`` ... ``response.completed``, each
numbered; a failure after the stream began is an ``error`` event, then ``response.failed``)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from conveyor.api.chat import arguments_complete
from conveyor.api.openai_call import Call, Emit
from conveyor.api.responses_api import ResponsesRequest, TextFormat, error_fields, in_responses_terms
from conveyor.api.tool_stream import CallStart, Part, Reasoning, Text
from conveyor.transport import Chunk, RequestError


class Reply:
    """One Responses call: its output items, and the Response object around them."""

    def __init__(self, call: Call, request: ResponsesRequest):
        self.call = call
        self.request = request
        self.created_at = call.created
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.sequence = 0

    def items(self) -> list[dict[str, Any]]:
        message, _ = self.call.message(0)
        incomplete = self.call.finish_reasons[0] == "length"
        items = []
        if message.get("reasoning_content"):
            items.append(_reasoning_item(self.reasoning_id, message["reasoning_content"]))
        if message["content"]:
            items.append({"type": "message", "id": self.message_id, "status": "completed", "role": "assistant",
                          "content": [_text_part(message["content"])]})
        for tool_call in message.get("tool_calls", []):
            items.append({"type": "function_call", "id": _function_call_id(tool_call["id"]),
                          "call_id": tool_call["id"], "name": tool_call["function"]["name"],
                          "arguments": tool_call["function"]["arguments"],
                          # (a call cut off by max_output_tokens is no call to run)
                          "status": "completed" if arguments_complete(tool_call) else "incomplete"})
        if incomplete and items and items[-1]["type"] != "function_call":
            items[-1]["status"] = "incomplete"  # (the thinking or the text max_output_tokens cut off)
        return items

    def response(self, output: list[dict[str, Any]] | None = None, status: str | None = None,
                 error: dict[str, str] | None = None) -> dict[str, Any]:
        """The Response object: in progress or failed (``output`` given, with its status and ``error``), or
        finished."""
        request, call = self.request, self.call
        if output is None:
            output = self.items()
            status = "incomplete" if call.finish_reasons[0] == "length" else "completed"
        usage = call.usage()
        fmt = request.text.format if request.text is not None and request.text.format is not None else None
        return {
            "id": call.id, "object": "response", "created_at": self.created_at, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": call.model, "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id, "reasoning": None, "store": request.store,
            "temperature": request.temperature, "top_p": request.top_p,
            "text": {"format": _format_echo(fmt)},
            "tool_choice": request.tool_choice or "auto",  # (OpenAI's default, with tools or without)
            "tools": [msgspec.to_builtins(t) for t in request.tools or []], "truncation": "disabled",
            # (the prompt tokens computed are those written to the prefix cache; none counted yet in progress)
            "usage": None if status == "in_progress" else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": call.num_cached_tokens,
                                         "cache_write_tokens": usage["prompt_tokens"] - call.num_cached_tokens},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": call.reasoning_tokens[0]},
                "total_tokens": usage["total_tokens"]},
            "user": request.user, "metadata": request.metadata or {},
            "completed_at": int(time.time()) if status == "completed" else None,
        }

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    async def stream(self, emit: Emit, begin: Any) -> dict[str, Any]:
        """The call as the Responses API's typed events; returns the final Response, its output in the order the
        items began. Text and a call's arguments stream as they are generated. The stream opens once the engine
        took the request (one it refuses is an HTTP error)."""
        call = self.call
        opened = False
        order: list[str] = []  # the items' ids, as they began
        calls: dict[int, str] = {}  # a call's index -> its item's id
        thinking: list[str] = []  # the reasoning item's deltas
        closed: set[str] = set()  # the items done before the end (the thinking, once the answer began)

        async def open_stream() -> None:
            nonlocal opened
            if not opened:
                opened = True
                await begin()
                await emit(self.event("response.created", response=self.response([], "in_progress")))
                await emit(self.event("response.in_progress", response=self.response([], "in_progress")))

        def where(item_id: str) -> dict[str, Any]:
            return {"item_id": item_id, "output_index": order.index(item_id)}

        async def close_thinking() -> None:
            # (thinking does not resume once the answer began: its item is done before the next is added, as
            # OpenAI's are)
            if self.reasoning_id in order and self.reasoning_id not in closed:
                closed.add(self.reasoning_id)
                await self._close(emit, _reasoning_item(self.reasoning_id, "".join(thinking)), where(self.reasoning_id))

        async def on_chunk(index: int, chunk: Chunk, parts: list[Part]) -> None:
            await open_stream()
            for part in parts:
                if not isinstance(part, Reasoning):
                    await close_thinking()
                if isinstance(part, Reasoning):
                    if self.reasoning_id not in order:
                        order.append(self.reasoning_id)
                        await emit(self.event("response.output_item.added", output_index=len(order) - 1, item={
                            **_reasoning_item(self.reasoning_id, ""), "status": "in_progress", "content": []}))
                        await emit(self.event("response.content_part.added", **where(self.reasoning_id),
                                              content_index=0, part={"type": "reasoning_text", "text": ""}))
                    thinking.append(part.text)
                    await emit(self.event("response.reasoning_text.delta", **where(self.reasoning_id),
                                          content_index=0, delta=part.text))
                elif isinstance(part, Text):
                    if self.message_id not in order:
                        order.append(self.message_id)
                        await emit(self.event("response.output_item.added", output_index=len(order) - 1, item={
                            "type": "message", "id": self.message_id, "status": "in_progress", "role": "assistant",
                            "content": []}))
                        await emit(self.event("response.content_part.added", **where(self.message_id),
                                              content_index=0, part=_text_part("")))
                    await emit(self.event("response.output_text.delta", **where(self.message_id), content_index=0,
                                          delta=part.text, logprobs=[]))
                elif isinstance(part, CallStart):
                    calls[part.index] = _function_call_id(part.id)
                    order.append(calls[part.index])
                    await emit(self.event("response.output_item.added", output_index=len(order) - 1, item={
                        "type": "function_call", "id": calls[part.index], "call_id": part.id, "name": part.name,
                        "arguments": "", "status": "in_progress"}))
                else:
                    await emit(self.event("response.function_call_arguments.delta", **where(calls[part.index]),
                                          delta=part.delta))

        try:
            await call.run(on_chunk)
        except RequestError as e:
            if not opened:
                raise  # (nothing went out yet: an HTTP error)
            return await self._fail(emit, in_responses_terms(e), order, closed)
        await open_stream()
        final = self.response()
        items = {item["id"]: item for item in final["output"]}
        final["output"] = [items[item_id] for item_id in order]
        for item in final["output"]:
            if item["id"] not in closed:
                await self._close(emit, item, where(item["id"]))
        status = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        await emit(self.event(status, response=final))
        return final

    async def _close(self, emit: Emit, item: dict[str, Any], at: dict[str, Any]) -> None:
        """An item's done events: its text's or arguments' done, its part's done, the item's done."""
        if item["type"] == "reasoning":
            part = item["content"][0]
            await emit(self.event("response.reasoning_text.done", **at, content_index=0, text=part["text"]))
            await emit(self.event("response.content_part.done", **at, content_index=0, part=part))
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            await emit(self.event("response.output_text.done", **at, content_index=0, text=text, logprobs=[]))
            await emit(self.event("response.content_part.done", **at, content_index=0, part=_text_part(text)))
        else:
            await emit(self.event("response.function_call_arguments.done", **at, name=item["name"],
                                  arguments=item["arguments"]))
        await emit(self.event("response.output_item.done", output_index=at["output_index"], item=item))

    async def _fail(self, emit: Emit, error: RequestError, order: list[str], closed: set[str]) -> dict[str, Any]:
        """A failure after the stream's 200: the ``error`` event, then ``response.failed`` with the items as far as
        they came (each "incomplete" but those already done); returns that response."""
        await emit(self.event("error", **error_fields(error.message, error.status, error.param)))
        items = {item["id"]: item for item in self.items()}
        output = [items[item_id] if item_id in closed else {**items[item_id], "status": "incomplete"}
                  for item_id in order]
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"  # (ResponseError's codes)
        failed = self.response(output, "failed", {"code": code, "message": error.message})
        await emit(self.event("response.failed", response=failed))
        return failed


def _format_echo(fmt: TextFormat | None) -> dict[str, Any]:
    """``text.format`` as OpenAI echoes it: a JSON schema's fields, the type alone for text and a JSON object."""
    if fmt is None or fmt.type != "json_schema":
        return {"type": fmt.type if fmt is not None else "text"}
    return {"type": "json_schema", "name": fmt.name, "schema": fmt.schema, "strict": fmt.strict,
            "description": fmt.description}


def _function_call_id(call_id: str) -> str:
    return "fc_" + call_id.removeprefix("call_")


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
