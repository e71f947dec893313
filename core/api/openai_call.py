"""One completions or chat completions call: its n choices run through the frontend, then the OpenAI response
object, or the stream of chunk objects (handed to an ``Emit``; HTTP sends each as a server-sent event), assembled
from what they produced."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from conveyor.api import openai_api as api
from conveyor.api.chat import finish_reason as chat_finish_reason
from conveyor.api.chat import reply_reader, thinks
from conveyor.api.tool_calls import Tools
from conveyor.api.tool_stream import Arguments, CallStart, Part, Reasoning, ReplyReader, Text
from conveyor.messages import LoraAdapter, TokenLogprob
from conveyor.transport import Chunk, Frontend, RequestError

# sends one event (a JSON object: HTTP's server-sent event); the first sends the response's status and headers
# before it
Emit = Callable[[dict[str, Any]], Awaitable[None]]
# what a choice's chunk added: the chunk, and the parts of the reply it completed (text, tool calls' starts and
# their arguments' deltas)
OnChunk = Callable[[int, Chunk, list[Part]], Awaitable[None]]


class Call:
    """One completions or chat completions call, with its n choices of each prompt."""

    def __init__(self, frontend: Frontend, body: Any, prompts: list[list[int]], params: Any, chat: bool, created: int,
                 tools: Tools | None = None, lora: LoraAdapter | None = None, id_prefix: str | None = None):
        """
        Args:
            prompts: the prompts' token ids: chat's one, or a completions batch (each prompt its own engine
                requests; choice ``prompt_index * n + i`` is the i-th of prompt ``prompt_index``).
            created: when the request came (Unix seconds): the response's ``created``, and every chunk's.
            tools: a chat call's tools; where they are active, replies are read for calls as they are generated.
            lora: the LoRA adapter the call's ``model`` names (None: the base model).
            id_prefix: the call's id begins with it (default: OpenAI's, "chatcmpl" or "cmpl").
        """
        self.frontend = frontend
        self.lora = lora
        # the name replies carry: the one the client asked for
        self.model = body.model or frontend.model_name
        self.tools = tools if tools is not None and tools.active else None
        self.body = body
        self.prompts = prompts
        self.params = params
        self.chat = chat
        self.created = created
        self.id = frontend.new_request_id(id_prefix or ("chatcmpl" if chat else "cmpl"))
        self.object = "chat.completion" if chat else "text_completion"
        self.num_choices = num = len(prompts) * body.n
        self.texts = [""] * num
        self.token_ids: list[list[int]] = [[] for _ in range(num)]
        self.logprobs: list[list[Any]] = [[] for _ in range(num)]
        self.finish_reasons: list[str | None] = [None] * num
        # the stop string that ended each choice, if one did
        self.stop_strings: list[str | None] = [None] * num
        # structured output: whether each choice's answer was closed to fit max_tokens (Chunk.grammar_closed)
        self.grammar_closed = [False] * num
        # each choice's reply read for its thinking (with a reasoning parser) and tool calls (all text where no
        # tools are active)
        self.reasoning = chat and thinks(frontend, params)
        self.readers = [reply_reader(frontend, prompts[0], self.tools, params) if chat else ReplyReader(False)
                        for _ in range(num)]
        # generated tokens that were thinking, by choice
        self.reasoning_tokens = [0] * num
        # prompt tokens found in the prefix cache, by prompt
        self.cached_tokens = [0] * len(prompts)
        # with params.prompt_logprobs: each choice's entry for each position of its prompt (None: the first)
        wanted = params.prompt_logprobs is not None
        self.prompt_logprobs: list[list[TokenLogprob | None]] = [[None] * len(prompts[i // body.n]) if wanted else []
                                                                 for i in range(num)]

    @property
    def num_cached_tokens(self) -> int:
        return sum(self.cached_tokens)

    async def run(self, on_chunk: OnChunk | None = None) -> None:
        async def collect(index: int, chunk: Chunk) -> None:
            reader = self.readers[index]
            if reader.thinking is not None and reader.thinking.thinking:
                self.reasoning_tokens[index] += len(chunk.token_ids)
            parts = reader.feed(chunk.text, final=chunk.finish_reason is not None)
            prompt = index // self.body.n
            self.cached_tokens[prompt] = max(self.cached_tokens[prompt], chunk.num_cached_tokens)
            if on_chunk is not None:
                await on_chunk(index, chunk, parts)
            self.texts[index] += chunk.text
            self.token_ids[index] += chunk.token_ids
            self.logprobs[index] += chunk.logprobs or []
            for position, entry in enumerate(chunk.prompt_logprobs or [], start=chunk.prompt_logprobs_start):
                self.prompt_logprobs[index][position] = entry
            self.finish_reasons[index] = chunk.finish_reason
            self.stop_strings[index] = chunk.stop_string
            self.grammar_closed[index] = chunk.grammar_closed

        refused: list[RequestError] = []

        async def choices(prompt: int) -> None:
            n = self.body.n
            request_id = self.id if len(self.prompts) == 1 else f"{self.id}-{prompt}"
            try:
                await self.frontend.run_choices(self.prompts[prompt], self.params, n, request_id=request_id,
                                                priority=self.body.priority, lora=self.lora,
                                                on_chunk=lambda i, chunk: collect(prompt * n + i, chunk))
            except RequestError as e:
                refused.append(e)
                group.cancel_scope.cancel()  # (the other prompts' requests are aborted)

        async with anyio.create_task_group() as group:
            for prompt in range(len(self.prompts)):
                group.start_soon(choices, prompt)
        if refused:
            error = refused[0]
            if error.param == "structured":  # the engine refused the language: name the field that carried it
                error.param = api.structured_field(self.body) or "tools"
            raise error

    def usage(self) -> dict[str, Any]:
        return api.usage(sum(map(len, self.prompts)), sum(map(len, self.token_ids)), self.num_cached_tokens)

    def _logprobs(self, index: int, token_ids: list[int], logprobs: list[Any], text_offset: int) -> Any:
        if self.params.logprobs is None:
            return None
        tokenizer = self.frontend.tokenizer
        if self.chat:
            return api.chat_logprobs(tokenizer, token_ids, logprobs)
        return api.completion_logprobs(tokenizer, token_ids, logprobs, text_offset)

    def result(self) -> dict[str, Any]:
        choices = []
        for i in range(self.num_choices):
            choice: dict[str, Any] = {"index": i}
            finish_reason = self.finish_reasons[i]
            if self.chat:
                choice["message"], finish_reason = self.message(i)
            else:
                choice["text"] = self.texts[i]
            choice["logprobs"] = self._logprobs(i, self.token_ids[i], self.logprobs[i], 0)
            choice["finish_reason"] = finish_reason
            if self.grammar_closed[i]:
                choice["grammar_closed"] = True
            if self.params.prompt_logprobs is not None and not self.chat:  # (vLLM's: each choice its prompt's)
                choice["prompt_logprobs"] = self._prompt_logprobs(i)
            choices.append(choice)
        extra = {}
        if self.params.prompt_logprobs is not None and self.chat:  # (vLLM's: the response's, of its one prompt)
            extra["prompt_logprobs"] = self._prompt_logprobs(0)
        return api.envelope(self.id, self.object, self.model, self.created, choices, usage=self.usage(), **extra)

    def _prompt_logprobs(self, index: int) -> list[Any]:
        prompt = self.prompts[index // self.body.n]
        return api.prompt_logprobs(self.frontend.tokenizer, prompt, self.prompt_logprobs[index])

    def message(self, index: int) -> tuple[dict[str, Any], str | None]:
        """A chat choice's message (its text and tool calls, as read), and its finish reason (``_finish_reason``)."""
        reader = self.readers[index]
        message: dict[str, Any] = {"role": "assistant", "content": reader.content}
        if self.reasoning:
            message["reasoning_content"] = reader.thinking.reasoning or None
        if reader.calls:
            message.update(content=reader.content or None, tool_calls=reader.calls)
        return message, chat_finish_reason(reader, self.finish_reasons[index])

    async def stream(self, emit: Emit, begin: Callable[[], Awaitable[None]]) -> None:
        """The call as server-sent chunk objects (``begin()`` sends the response's status and headers)."""
        include_usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        model = self.model
        extra = {"usage": None} if include_usage else {}
        opened = False

        async def open_stream() -> None:
            # The status, then a chat's roles, as OpenAI sends them first, once the engine took the request (its
            # first chunk): a request it refuses (a full queue, a TTFT target, a grammar that does not compile) is
            # a 4xx like any other bad request, not an event after a 200.
            nonlocal opened
            if opened:
                return
            opened = True
            await begin()
            for i in range(self.num_choices if self.chat else 0):
                choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}
                await emit(api.envelope(self.id, chunk_object, model, self.created, [choice], **extra))

        async def on_chunk(index: int, chunk: Chunk, parts: list[Part]) -> None:
            await open_stream()
            wants_logprobs = self.params.logprobs is not None and chunk.token_ids
            if not parts and chunk.finish_reason is None and not wants_logprobs:
                return  # nothing to show yet (the engine took the request, or a character or a stop string is pending)
            finish_reason = chunk.finish_reason
            if self.chat:
                finish_reason = chat_finish_reason(self.readers[index], finish_reason)
                fields = [{"delta": _delta(part)} for part in parts] or [{"delta": {}}]
            else:
                fields = [{"text": chunk.text}]
            offset = len(self.texts[index])
            logprobs = self._logprobs(index, chunk.token_ids, chunk.logprobs or [], offset)
            for j, field in enumerate(fields):
                last = j == len(fields) - 1
                choice = {"index": index, **field, "logprobs": logprobs if j == 0 else None,
                          "finish_reason": finish_reason if last else None}
                if last and chunk.grammar_closed:
                    choice["grammar_closed"] = True
                await emit(api.envelope(self.id, chunk_object, model, self.created, [choice], **extra))

        await self.run(on_chunk)
        await open_stream()
        if include_usage:
            await emit(api.envelope(self.id, chunk_object, model, self.created, [], usage=self.usage()))


def _delta(part: Part) -> dict[str, Any]:
    """A chat chunk's delta for one part of the reply."""
    if isinstance(part, Text):
        return {"content": part.text}
    if isinstance(part, Reasoning):
        return {"reasoning_content": part.text}
    if isinstance(part, CallStart):
        return {"tool_calls": [{"index": part.index, "id": part.id, "type": "function",
                                "function": {"name": part.name, "arguments": ""}}]}
    assert isinstance(part, Arguments)
    return {"tool_calls": [{"index": part.index, "function": {"arguments": part.delta}}]}
