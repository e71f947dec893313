"""Prefill/decode disaggregation: prefill engines and decode engines behind one frontend, as one engine client.

Prefill is compute-bound and decode bandwidth-bound; on one engine a long prompt's chunks stretch every running
request's inter-token latency. With ``[parallel] prefill_engines`` and ``decode_engines`` the frontend runs
both kinds of engine process (``MPClient`` each, on the same config) and a request visits two of them:

1. A prefill engine (the least loaded, or the one holding the prompt's prefix) runs a copy of the request that
   makes one token, which is dropped. Its KV connector (``tiers``, on a directory every engine shares, in
   shared memory by default) stores each block of the prompt as it fills.
2. A decode engine gets the request itself with ``kv_transfer``: its connector holds the request until the
   prompt's blocks are stored (at most ``[parallel] kv_transfer_timeout`` seconds), loads them, and the engine
   computes the prompt's last, partial block and streams every token.

(DistServe, OSDI'24, and Splitwise split the phases so; vLLM's disaggregated-prefill proxy routes the same
way: one token from the prefill instance, then the request to the decode instance.)

Failures. A prefill engine that is down, dies, or is killed for going silent (``[server] engine_timeout``):
its requests go to a decode engine without a transfer and are computed there. A refusal (400, 413, 422, 429)
or an abort on the prefill engine ends the request as on one engine. A decode engine that dies ends its
requests with 503 and restarts, as one engine does; with none running, new requests get 503.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

from conveyor.config import Config, ConfigError
from conveyor.config.schema import PluginSpec
from conveyor.engine.client import EngineClient, EngineUnavailable
from conveyor.engine.dp_client import DPClient
from conveyor.engine.mp_client import MPClient
from conveyor.engine.router import Router
from conveyor.messages import EngineRequest, KVTransfer, RequestOutput
from conveyor.registry import PluginRegistry
from conveyor.request import FinishReason

# error statuses from a prefill engine that end the request (a decode engine would refuse it the same way);
# any other error (503: the engine died; 500: its step failed) sends the request to a decode engine to compute
REFUSALS = frozenset({400, 413, 422, 429})


class PDClient(DPClient):
    """Prefill engines (replicas ``0 .. num_prefill - 1``) and decode engines (the rest) as one engine client.

    Args:
        replicas: the engine clients, prefill engines first.
        num_prefill: how many of them prefill.
        transfer_timeout: seconds a decode engine waits for a prompt's blocks.
        directory: a directory this client made for the blocks, removed when ``run`` ends.
    """

    down = "no decode engine is running (starting, restarting or stopping)"

    def __init__(self, replicas: Sequence[EngineClient], num_prefill: int, transfer_timeout: float,
                 directory: Path | None = None, router: Router | None = None):
        super().__init__(replicas, router)
        if not 0 < num_prefill < len(self.replicas):
            raise ValueError(f"num_prefill={num_prefill}: needs at least one prefill and one decode engine")
        self.num_prefill = num_prefill
        self.transfer_timeout = transfer_timeout
        self.directory = directory
        # where the prompts' blocks go (the engines' connector options name it)
        self.kv_dir = str(directory) if directory is not None else ""
        # per replica: "prefill" or "decode" (the label its metrics carry)
        self.roles = ["prefill"] * num_prefill + ["decode"] * (len(self.replicas) - num_prefill)

    @classmethod
    def from_config(cls, config: Config, **options: Any) -> PDClient:
        """``prefill_engines + decode_engines`` engine processes (``MPClient``, with ``options`` as there), their
        connector set up to hand the prompts' KV over (``transfer_config``)."""
        config, directory = transfer_config(config)
        num_prefill, num_decode = config.parallel.prefill_engines, config.parallel.decode_engines
        replicas = [MPClient(config, replica=index, **options) for index in range(num_prefill + num_decode)]
        client = cls(replicas, num_prefill, config.parallel.kv_transfer_timeout, directory,
                     Router(num_prefill + num_decode))
        client.kv_dir = config.connector.options.disk_dir
        return client

    @property
    def alive(self) -> bool:
        """Whether a decode engine takes requests now (every request ends on one)."""
        return any(replica.alive for replica in self.replicas[self.num_prefill :])

    @alive.setter
    def alive(self, value: bool) -> None:
        pass  # EngineClient.__init__ sets it; here it follows the decode engines

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """``DPClient.run``; the directory this client made goes when the engines have stopped."""
        try:
            await super().run(task_status=task_status)
        finally:
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Prefill on a prefill engine, then decode on a decode engine; yield the decode engine's outputs (see
        ``EngineClient.generate``).

        Raises:
            EngineUnavailable: no decode engine is running.
            RequestRejected: the request id is in flight already.
        """
        hashes = self._admit(request)
        # the prompt's full blocks before its last token (that one is always computed: its logits pick a token)
        num_blocks = (len(request.prompt_token_ids) - 1) // self.router.block_size
        transfer = None
        if num_blocks and not request.params.pooling:
            prefill = self._choose(range(self.num_prefill), hashes)
            if prefill is not None:
                stored, ended = await self._prefill(prefill, request)
                if ended is not None:
                    yield ended
                    return
                if stored:
                    transfer = KVTransfer(num_blocks, self.transfer_timeout)
        decode = self._choose(range(self.num_prefill, len(self.replicas)), hashes)
        if decode is None:
            raise EngineUnavailable(self.down)
        self._owners[request.request_id] = decode
        try:
            async with aclosing(self.replicas[decode].generate(msgspec.structs.replace(request, kv_transfer=transfer))
                                ) as outputs:
                async for output in outputs:
                    yield output
        finally:
            del self._owners[request.request_id]

    async def _prefill(self, index: int, request: EngineRequest) -> tuple[bool, RequestOutput | None]:
        """Run the request's prompt on prefill engine ``index`` (one token, dropped).

        Returns:
            Whether the prompt was computed there (its blocks are being stored), and the final output that ends
            the request here (refused or aborted) or None to go on to a decode engine.
        """
        params = msgspec.structs.replace(request.params, max_tokens=1, min_tokens=0, logprobs=None,
                                         prompt_logprobs=None, structured=None, stop=[], stop_token_ids=[])
        self._owners[request.request_id] = index
        try:
            async with aclosing(self.replicas[index].generate(msgspec.structs.replace(request, params=params))
                                ) as outputs:
                async for output in outputs:
                    if output.finish_reason is None:
                        continue
                    if output.finish_reason == FinishReason.ABORT.value:
                        return False, output
                    if output.finish_reason == FinishReason.ERROR.value:
                        return False, output if output.error_status in REFUSALS else None
                    return True, None
        except EngineUnavailable:  # (it went down since it was chosen)
            pass
        finally:
            del self._owners[request.request_id]
        return False, None


# the transfer directories this client makes: TRANSFER_PREFIX, the pid of the process that made it, "-", a suffix
TRANSFER_PREFIX = "conveyor-kv-"


def remove_orphans(parent: Path) -> list[Path]:
    """Removes the transfer directories in ``parent`` whose process has gone without removing its own (killed:
    SIGKILL, a crash); in shared memory they would hold their KV blocks in RAM until the machine restarts. Only
    the user's own, and only where no process of that pid runs. Returns those removed."""
    removed = []
    for path in parent.glob(f"{TRANSFER_PREFIX}*-*"):
        pid = path.name[len(TRANSFER_PREFIX) :].split("-", 1)[0]
        try:
            if not pid.isdigit() or path.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except OSError:  # (gone already, or a process of that pid that is not ours: alive)
            continue
    return removed


def transfer_config(config: Config) -> tuple[Config, Path | None]:
    """The engines' config: the ``tiers`` connector with its disk tier on the transfer directory; and that
    directory when it is a new one (in shared memory where there is some), for the caller to remove.

    Raises:
        ConfigError: another connector is configured.
    """
    spec = config.connector
    if spec.plugin not in ("none", "tiers"):
        raise ConfigError(f"{config.source}: [connector] plugin = {spec.plugin!r}: prefill and decode engines "
                          "hand the KV over through the 'tiers' connector; allowed: 'none' (tiers in shared "
                          "memory), 'tiers'")
    parallel = config.parallel
    disk_dir = parallel.kv_transfer_dir or (spec.options.disk_dir if spec.plugin == "tiers" else "")
    directory = None
    options = spec.options if spec.plugin == "tiers" else \
        PluginRegistry.of(config).declaration("connector", "tiers").options()
    if not disk_dir:
        parent = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        remove_orphans(parent)
        directory = Path(tempfile.mkdtemp(prefix=f"{TRANSFER_PREFIX}{os.getpid()}-", dir=parent))
        disk_dir = str(directory)
        # the engines' workers share the space: each keeps its blocks within its part of most of it
        workers = (parallel.prefill_engines + parallel.decode_engines) * parallel.world_size
        space = shutil.disk_usage(directory).free * 0.8 / workers / 2**30
        options = msgspec.structs.replace(options, disk_gb=min(options.disk_gb, space))
    options = msgspec.structs.replace(options, disk_dir=disk_dir)
    engines = msgspec.structs.replace(config, connector=PluginSpec("tiers", options))
    engines._registry = PluginRegistry.of(config)
    return engines, directory
