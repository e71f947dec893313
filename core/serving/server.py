"""``conveyor serve``: the frontend process, its transports, and the engine process behind them.

Start-up prints where the server listens, the model, the KV capacity and an
example curl. While busy, a one-line status is logged every
``[server] status_interval`` seconds. SIGINT or SIGTERM stops taking new
requests, lets in-flight ones finish for up to ``[server] drain_timeout``
seconds, aborts the rest, stops the engine and returns 0.

With ``[parallel] data_parallel_size`` above 1 the frontend runs that many
engine processes behind a router (``DPClient``) instead of one (``MPClient``); with ``prefill_engines`` and
``decode_engines``, prefill engines and decode engines (``PDClient``).
"""

from __future__ import annotations

import logging
import signal
import sqlite3
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio

from conveyor.batches.files import FileStore
from conveyor.config import Config, ConfigError, load_config
from conveyor.engine.client import EngineClient, EngineFailed
from conveyor.engine.dp_client import DPClient
from conveyor.engine.mp_client import MPClient
from conveyor.engine.pd_client import PDClient
from conveyor.messages import EngineReady
from conveyor.model.tokenizer import load_tokenizer
from conveyor.registry import PluginRegistry
from conveyor.serving.frontend import EngineFrontend
from conveyor.serving.metrics import ServerMetrics
from conveyor.serving.role_metrics import RoleMetrics

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger("conveyor")


def _file_store(config: Config) -> FileStore | None:
    """The Batch API's files, where ``[batch] dir`` is set.

    Raises:
        ConfigError: the folder cannot be made or its database opened (naming the key and the reason).
    """
    batch = config.batch
    if not batch.dir:
        return None
    try:
        return FileStore(batch.dir, batch.max_file_mb * 2**20)
    except (OSError, sqlite3.Error) as e:
        raise ConfigError(f"{config.source_of('batch')}: [batch] dir = {batch.dir!r}: {e}") from None


async def serve(config_path: str | Path | None, overrides: Mapping[str, Any] | None = None, log_level: str = "INFO") -> int:
    """Serve until SIGINT/SIGTERM; returns the process exit code.

    Raises:
        ConfigError, PluginError: the config is wrong (before anything starts).
    """
    config = load_config(config_path, overrides)
    registry = PluginRegistry.of(config)
    if not config.transport:
        raise ConfigError(f"{config.source}: no [[transport]] to serve on")
    try:
        transports = [registry.build("transport", spec) for spec in config.transport]
    except ValueError as e:  # (what a transport checks as it is built: its key files)
        raise ConfigError(f"{config.source}: {e}") from None
    tokenizer = load_tokenizer(config.model, source=config.source_of("model"))
    model_name = config.model.served_name
    files = _file_store(config)  # (before the engine client makes anything: a bad [batch] dir stops here)
    engine = _engine_client(config, log_level)
    metrics = _metrics(engine, model_name)
    try:
        frontend = EngineFrontend(engine, tokenizer, model_name, metrics, config.lora, config.model.reasoning_parser,
                                  config.model.pooling, config.scheduler,
                                  registry.get("scheduler", config.scheduler.plugin), config.model.aliases)
    except ValueError as e:
        raise ConfigError(f"{config.source}: {e}") from None
    frontend.files = files
    try:
        async with anyio.create_task_group() as tg:
            # Transports first: a busy port fails at once, and /health answers 503 while the model loads.
            urls = [await tg.start(transport.serve, frontend) for transport in transports]
            logger.info("starting the engine process; up at once (503 until it is ready): %s", ", ".join(urls))
            ready = await tg.start(engine.run)
            key_env = next((getattr(t.options, "api_key_env", "") for t, url in zip(transports, urls)
                            if url.startswith("http")), "")
            _print_banner(model_name, config.kvcache.plugin, ready, urls, key_env, bool(tokenizer.chat_template))
            if isinstance(engine, PDClient):
                pids = [str(r.pid) if r is not None else "?" for r in engine.readies]
                prefill, decode = ", ".join(pids[: engine.num_prefill]), ", ".join(pids[engine.num_prefill :])
                print(f"Prefill/decode: {engine.num_prefill} prefill engines (pids {prefill}) and "
                      f"{len(pids) - engine.num_prefill} decode engines (pids {decode}), each with the KV cache "
                      f"above; prompts' KV moves through {engine.kv_dir}", flush=True)
            elif isinstance(engine, DPClient):
                pids = ", ".join(str(r.pid) for r in engine.readies if r is not None)
                print(f"Data parallel: {len(engine.replicas)} engine replicas (pids {pids}), each with the KV "
                      "cache above; requests go to the least loaded one or the one holding their prefix", flush=True)
            if config.server.status_interval:
                tg.start_soon(_report_status, frontend, config.server.status_interval)
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    logger.info("%s: draining %d requests (up to %.0f s; again: abort them now)",
                                signal.Signals(signum).name, frontend.num_in_flight, config.server.drain_timeout)
                    break
                hurry = anyio.Event()
                async with anyio.create_task_group() as stopping:  # (a second signal ends the drain at once)
                    stopping.start_soon(_hurry, signals, hurry, frontend)
                    await _drain(frontend, config.server.drain_timeout, hurry)
                    await engine.shutdown()
                    stopping.cancel_scope.cancel()
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        failed = group.subgroup((EngineFailed, OSError))
        if failed is None:
            raise
        while isinstance(failed, BaseExceptionGroup):
            failed = failed.exceptions[0]
        logger.error("error: %s", failed)
        return 1
    except (EngineFailed, OSError) as e:
        logger.error("error: %s", e)
        return 1
    finally:
        if files is not None:
            files.close()
    logger.info("stopped")
    return 0


def _engine_client(config: Config, log_level: str) -> EngineClient:
    """One engine process, ``data_parallel_size`` of them behind a router, or prefill and decode engines."""
    options = {
        "address": config.server.engine_address,
        "max_restarts": config.server.max_engine_restarts,
        "engine_timeout": config.server.engine_timeout,
        "log_level": log_level,
    }
    if config.parallel.prefill_engines:
        return PDClient.from_config(config, **options)
    if config.parallel.data_parallel_size > 1:
        return DPClient.from_config(config, **options)
    return MPClient(config, **options)


def _metrics(engine: EngineClient, model_name: str) -> ServerMetrics:
    """The server's metrics, fed by the engine's observers (per replica with several)."""
    if isinstance(engine, DPClient):
        replicas = engine.replicas
        metrics = ServerMetrics(model_name, len(replicas), replica_alive=lambda i: replicas[i].alive,
                                replica_in_flight=lambda i: replicas[i].num_in_flight)
        engine.replica_stats_observers.append(metrics.engine_step)
        engine.replica_ready_observers.append(metrics.engine_ready)
        if isinstance(engine, PDClient):
            roles = RoleMetrics(metrics.registry, model_name, engine.roles)
            engine.replica_stats_observers.append(roles.observe)
            engine.replica_ready_observers.append(lambda ready, replica: roles.engine_ready(replica))
        return metrics
    metrics = ServerMetrics(model_name)
    engine.stats_observers.append(metrics.engine_step)
    engine.ready_observers.append(metrics.engine_ready)
    return metrics


async def _hurry(signals: Any, hurry: anyio.Event, frontend: EngineFrontend) -> None:
    """Signals that come while the server stops: the first ends the drain (the requests still running are
    aborted), the others are noted; none interrupts the stop."""
    async for signum in signals:
        name = signal.Signals(signum).name
        if hurry.is_set():
            logger.info("%s: stopping already", name)
            continue
        logger.warning("%s again: aborting the %d requests still running", name, frontend.num_in_flight)
        hurry.set()


async def _drain(frontend: EngineFrontend, timeout: float, hurry: anyio.Event) -> None:
    """Refuse new work and wait up to ``timeout`` (or until ``hurry`` is set) for the requests in flight; abort
    those still running then."""
    frontend.draining = True
    with anyio.move_on_after(timeout):
        while frontend.num_in_flight and not hurry.is_set():
            await anyio.sleep(0.05)
    if frontend.num_in_flight:
        if not hurry.is_set():
            logger.warning("aborting %d requests still running after %.0f s", frontend.num_in_flight, timeout)
        frontend.engine.abort_all()
        with anyio.move_on_after(5):
            while frontend.num_in_flight:
                await anyio.sleep(0.05)


async def _report_status(frontend: EngineFrontend, interval: float) -> None:
    """A line every ``interval`` while requests are in flight, and one after any that came and went between
    two ticks (a burst shorter than the interval is reported too); none while idle."""
    while True:
        await anyio.sleep(interval)
        if frontend.num_in_flight or frontend.metrics.active_since_status_line:
            logger.info("%s", frontend.metrics.status_line())


def _weight_formats(ready: EngineReady) -> str:
    """The banner's ' (quant auto: Q4_1 66.4 MB, Q8_0 30.1 MB)': the quant method and what the weights are kept
    as, largest first."""
    if not ready.quant:
        return ""
    kept = sorted(((n, f) for f, n in ready.weight_formats.items() if f != "copies"), reverse=True)
    parts = [f"{format} {n / 1e6:.1f} MB" for n, format in kept]
    if ready.weight_formats.get("copies"):
        parts.append(f"and {ready.weight_formats['copies'] / 1e6:.1f} MB of decode copies")
    return f" (quant {ready.quant}: {', '.join(parts)})" if parts else f" (quant {ready.quant})"


def _print_banner(model_name: str, kv_layout: str, ready: EngineReady, urls: list[str], key_env: str = "",
                  chat: bool = True) -> None:
    """The start-up lines: what is served, where, the dashboard, and a request to try (sending the API key from
    ``key_env``, the variable that holds it, where the HTTP transport needs one; a chat request where the model has
    a chat template, else a completion)."""
    note = f": {ready.max_model_len_note}" if ready.max_model_len_note else ""
    lines = [
        (
            f"Conveyor is serving {model_name} (max_model_len {ready.max_model_len}{note}; engine pid {ready.pid}, "
            f"ready in {ready.load_time:.1f} s)"
        ),
        (
            f"KV cache ({kv_layout}): {ready.num_kv_blocks} blocks x {ready.block_size} tokens; "
            f"{ready.max_concurrency:.1f} requests of max_model_len fit at once"
        ),
        f"Weights: {ready.weight_bytes / 1e6:.1f} MB on {ready.device}{_weight_formats(ready)}; "
        f"attention backend {ready.attention!r}",
        *([f"Quantization: {ready.quant_note}"] if ready.quant_note else []),
    ]
    lines += [f"Listening on {url}" for url in urls]
    http = next((u for u in urls if u.startswith("http")), None)
    if http:
        body = ('"messages": [{"role": "user", "content": "Name the capital of France."}]' if chat
                else '"prompt": "The capital of France is", "max_tokens": 8')
        lines += [
            f"Dashboard: {http}/dashboard",
            "Try:" if chat else "Try (the model has no chat template: [model] chat_template gives it one):",
            f"  curl {http}/v1/{'chat/' if chat else ''}completions -H 'Content-Type: application/json' \\",
            *([f'    -H "Authorization: Bearer ${key_env}" \\'] if key_env else []),
            f"    -d '{{\"model\": \"{model_name}\", {body}, \"temperature\": 0}}'",
        ]
    else:
        lines.append("No HTTP: the config's [[transport]] tables replace the default one; add a table with "
                     "plugin = \"http\" to serve it beside them")
    print("\n".join(lines), flush=True)
