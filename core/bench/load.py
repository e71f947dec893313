"""The load generator: send a workload to an OpenAI-compatible server on an arrival schedule, streaming every
request, and record what each client saw."""

from __future__ import annotations

import itertools
import json
import math
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import anyio
import httpx
import msgspec
from prometheus_client.samples import Sample

from conveyor.bench.arrivals import arrival_times
from conveyor.bench.stats import RequestRecord
from conveyor.perf.readings import metric_samples


class BenchRequest(msgspec.Struct):
    """One request of a workload: a chat conversation or a completion prompt."""

    # [{"role": ..., "content": ...}] for /v1/chat/completions, or None
    messages: list[dict[str, Any]] | None
    # text or token ids for /v1/completions, or None
    prompt: str | list[int] | None
    # prompt tokens as the workload's tokenizer counts them (the server's usage wins when it reports one)
    prompt_tokens: int
    max_tokens: int


class _Usage(msgspec.Struct):
    # the server's counts; a count it leaves out is the load generator's own (content chunks, the workload)
    completion_tokens: int | msgspec.UnsetType = msgspec.UNSET
    prompt_tokens: int | msgspec.UnsetType = msgspec.UNSET


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    # chat completions stream a delta, completions a text
    delta: _Delta | None = None
    text: str | None = None


class _StreamEvent(msgspec.Struct):
    """What the load generator reads of one streamed event; any other field is ignored."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


# NOTE: a typed decoder, so that an event of another shape (not an object, a null token count) fails its one
# request with the path of the bad field rather than raising inside the run and aborting every request.
_decode_event = msgspec.json.Decoder(_StreamEvent).decode


class LoadOptions(msgspec.Struct):
    # requests per second; inf: all at once
    rate: float = math.inf
    # gamma shape of the gaps between arrivals; 1: Poisson
    burstiness: float = 1.0
    # most requests in flight; 0: no limit
    max_concurrency: int = 0
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = None


def base_url(url: str) -> str:
    """``http://host:port`` from a URL that may end in /v1."""
    return url.rstrip("/").removesuffix("/v1")


async def served_model(client: httpx.AsyncClient, url: str, api_key: str | None = None,
                       ready_timeout: float = 600.0) -> str:
    """The first model the server lists at /v1/models, once it lists one.

    A server that does not answer yet, or answers 503 (its engine still starting, as Conveyor's and vLLM's do),
    is asked again every second, saying so on stderr, for up to ``ready_timeout`` seconds.

    Raises:
        ValueError: the server refused the request (e.g. 401: the API key), or was not ready in time.
    """
    endpoint = f"{base_url(url)}/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.monotonic()
    said = -math.inf  # when the wait was last reported
    while True:
        try:
            response = await client.get(endpoint, headers=headers)
            if response.status_code == 200:
                models = response.json().get("data") or []
                if not models:
                    raise ValueError(f"{endpoint} lists no model: pass --model")
                return models[0]["id"]
            if response.status_code != 503:
                hint = " (pass --api-key)" if response.status_code == 401 else ""
                raise ValueError(f"{endpoint}: {response.status_code} {_error_message(response.text)}{hint}")
            why = f"503 {_error_message(response.text)}"
        except httpx.TransportError as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        waited = time.monotonic() - start
        if waited >= ready_timeout:
            raise ValueError(f"{endpoint} was not ready after {ready_timeout:g} s ({why})")
        if waited - said >= 15:
            print(f"waiting for {endpoint} ({why}); {waited:.0f} s so far", file=sys.stderr, flush=True)
            said = waited
        await anyio.sleep(1.0)


async def scrape_metrics(client: httpx.AsyncClient, url: str) -> list[Sample]:
    """The server's Prometheus samples; empty when it has no /metrics."""
    try:
        response = await client.get(f"{base_url(url)}/metrics")
    except httpx.HTTPError:
        return []
    if response.status_code != 200:
        return []
    try:
        return list(metric_samples(response.text))
    except ValueError:  # not Prometheus text
        return []


def metric_totals(samples: Iterable[Sample]) -> dict[str, float]:
    """Sums of samples by name (labels dropped)."""
    totals: dict[str, float] = {}
    for sample in samples:
        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def run_load(
    url: str,
    model: str,
    requests: Sequence[BenchRequest],
    options: LoadOptions,
    on_done: Any = None,
) -> tuple[list[RequestRecord], float]:
    """Send every request on its arrival time; return the records (in workload order) and the run's duration.

    Args:
        on_done: called with each RequestRecord as it finishes (progress).
    """
    times = arrival_times(len(requests), options.rate, options.burstiness, options.seed)
    records: list[RequestRecord | None] = [None] * len(requests)
    limit = anyio.Semaphore(options.max_concurrency) if options.max_concurrency else None
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()

        async def one(index: int, request: BenchRequest) -> None:
            try:
                record = await _send(client, url, model, request, options, index, start)
            finally:
                if limit is not None:
                    limit.release()
            records[index] = record
            if on_done is not None:
                on_done(record)

        async with anyio.create_task_group() as tg:
            for index, (request, at) in enumerate(zip(requests, times)):
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await anyio.sleep(delay)
                if limit is not None:
                    await limit.acquire()
                tg.start_soon(one, index, request)
        duration = time.perf_counter() - start
    return [r for r in records if r is not None], duration


def _payload(model: str, request: BenchRequest, options: LoadOptions) -> tuple[str, dict[str, Any]]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.ignore_eos:
        payload["ignore_eos"] = True
    if request.messages is not None:
        return "/v1/chat/completions", {**payload, "messages": request.messages}
    return "/v1/completions", {**payload, "prompt": request.prompt}


async def _send(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    request: BenchRequest,
    options: LoadOptions,
    index: int,
    run_start: float,
) -> RequestRecord:
    path, payload = _payload(model, request, options)
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    record = RequestRecord(index, request.prompt_tokens)
    sent = time.perf_counter()
    record.start = sent - run_start
    chunk_times: list[float] = []
    usage: _Usage | None = None
    done = False
    try:
        async with client.stream("POST", base_url(url) + path, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {_error_message(body)}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    event = _decode_event(data)
                except msgspec.DecodeError as e:
                    record.error = f"bad stream event ({e}): {data[:200]}"
                    break
                if event.error is not None:
                    record.error = f"stream error: {_error_message(data)}"
                    break
                for choice in event.choices or ():
                    if (choice.delta and choice.delta.content) or choice.text:
                        chunk_times.append(time.perf_counter())
                if event.usage is not None:
                    usage = event.usage
    except (httpx.HTTPError, OSError) as e:
        record.error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if record.error is None and not done:
        record.error = "the stream ended before [DONE]"
    if record.error is not None:
        return record
    record.e2e = end - sent
    record.ttft = (chunk_times[0] if chunk_times else end) - sent
    record.itl = [b - a for a, b in itertools.pairwise(chunk_times)]
    # without the server's usage, one token per content chunk is the best guess
    record.output_tokens = len(chunk_times)
    if usage is not None:
        if usage.completion_tokens is not msgspec.UNSET:
            record.output_tokens = usage.completion_tokens
        if usage.prompt_tokens is not msgspec.UNSET:
            record.prompt_tokens = usage.prompt_tokens
    return record


def _error_message(body: str) -> str:
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:300] or "(empty body)"
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:300]
        return str(error)[:300]
    return body[:300]
