"""The KV connector interface (plugin kind ``connector``): KV blocks kept or moved outside the engine's pool.

A connector has two sides. ``KVConnector`` lives with the scheduler, in the
engine core's process, and never touches a tensor: the KV cache manager asks
it how many of a request's next full blocks it holds (``lookup``), tells it
where to put those it takes (``load``) and hands it every block that became
full and final (``save``); it is also an admission gate, which may hold a
request while its blocks come from somewhere slow. ``KVConnectorWorker``
lives in each worker, beside the KV tensors, and carries out what its
scheduler side decided: the step message brings it an opaque payload
(``StepInput.kv_connector``) that it applies before the step's forward pass,
in order, and ``call`` carries one between steps. The two sides agree on
that payload's format; the engine only carries it. (vLLM's
``KVConnectorBase_V1`` has the same split: a scheduler role that answers
"how many tokens do you hold" and a worker role that moves the blocks.)

The contract, in the order a request meets it:

- A request is added: ``holds`` may keep it at the gate (status
  ``WAITING_FOR_KV``); ``release``, called before each step, lets it go on.
- At admission, after the pool's own prefix match of ``n`` blocks, the KV
  cache manager passes the request and the digests of its next full blocks
  to ``lookup``; for each of the first ``lookup(...)`` of them it allocates a
  block and calls ``load(digest, block)`` (unless memory is short: the
  request then waits, and ``lookup`` comes again). ``lookup`` may answer
  None instead: the scheduler then holds the request at the gate while the
  connector fetches its blocks (from somewhere slow), and asks again once
  ``release`` lets it go. The request's first step computes
  after them: the worker side must have filled them before that step's forward
  pass (the step carries ``take_payload()``).
- When a block of a request is full and its tokens computed, the manager
  calls ``save(digest, block)``. Its contents are final once the steps
  already submitted have run; the block is not reused before the next step
  the engine submits, which carries the payload; when the engine goes idle
  instead, it calls ``flush``, which carries it out at once.
- A request prefilled by another engine (prefill/decode disaggregation)
  carries ``request.kv_transfer``: the other engine's connector saves its
  prompt's blocks, and this one may hold it at the gate until they have
  come (``holds``, ``release``), for at most ``kv_transfer.timeout`` seconds.

A block's digest is the prefix cache's: its tokens chained to every token
before it and the request's cache salt (its LoRA adapter), so equal digests
hold equal keys and values for one model. ``fingerprint`` names the model,
quant method, KV dtype and layout a connector's blocks belong to: a store that
outlives the engine keys its blocks by both.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from conveyor.gates import AdmissionGate
from conveyor.kvcache import KVCacheLayout
from conveyor.messages import ConnectorStats
from conveyor.request import Request, RequestStatus

if TYPE_CHECKING:
    from conveyor.attention.storage import KVStorage
    from conveyor.config import Config
    from conveyor.kvcache import KVCacheManager


class KVConnector(AdmissionGate, ABC):
    """The scheduler side of a connector."""

    name: ClassVar[str]
    Options: ClassVar[type[msgspec.Struct]]
    # the worker side's class (built in every worker with ``Worker(options, storage, rank, setup)``)
    Worker: ClassVar[type[KVConnectorWorker]]
    status = RequestStatus.WAITING_FOR_KV

    def __init__(self, options: msgspec.Struct, layout: KVCacheLayout, fingerprint: str,
                 call: Callable[[bytes], list[bytes]]):
        """
        Args:
            options: an instance of ``Options``.
            layout: the device pool (the worker with the most layers: its block is the largest).
            fingerprint: what the blocks belong to (``kv_fingerprint``).
            call: runs ``KVConnectorWorker.call`` with a payload on every worker, between steps; their
                answers by rank.
        """
        self.options = options
        self.layout = layout
        self.fingerprint = fingerprint
        self.call = call
        # the KV cache manager that consults it (``KVCacheManager.attach`` sets it)
        self.kvcache: KVCacheManager | None = None

    @property
    def setup(self) -> bytes:
        """What every worker side is built with (after the pool exists), e.g. the sizes this side chose."""
        return b""

    def holds(self, request: Request) -> bool:
        """Whether a new request waits for its blocks (start fetching them).

        Args:
            request: a request as it reaches this gate.

        Returns:
            True to hold it (the base: never).
        """
        return False

    def release(self, held: list[Request], idle: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Let held requests go on.

        Args:
            held: the requests this gate holds, in arrival order.
            idle: no step is in flight on the workers (``call`` may run).

        Returns:
            The requests that go on now, and those that can never run with why (the base: all go on).
        """
        return held, []

    @abstractmethod
    def lookup(self, request: Request, digests: list[bytes]) -> int | None:
        """How many of a request's next blocks the connector can load now (the request is being admitted).

        Args:
            request: the request.
            digests: its next full blocks, in order, after those the pool holds.

        Returns:
            0 .. ``len(digests)``: a leading run; or None to fetch more of them first: the scheduler then holds
            the request at this gate (``WAITING_FOR_KV``) until ``release`` lets it go, and asks again.
        """

    @abstractmethod
    def load(self, digest: bytes, block: int) -> None:
        """Have a device block filled before the next step's forward pass.

        Args:
            digest: one of the blocks ``lookup`` counted.
            block: the device block the layout gave it.
        """

    @abstractmethod
    def save(self, digest: bytes, block: int) -> None:
        """A block became full and final (keep it, or not).

        Args:
            digest: its digest.
            block: the device block that holds it (final once the steps already submitted have run).
        """

    @abstractmethod
    def take_payload(self) -> bytes:
        """What the worker sides do before the next step's forward pass; the engine calls it once per step.

        Returns:
            The payload for ``KVConnectorWorker.apply`` (b"": nothing to do).
        """

    def flush(self) -> None:
        """The engine is idle (no step in flight, none to submit): carry out now what waits for the next step,
        so that saved blocks reach the store without a next request."""
        payload = self.take_payload()
        if payload:
            self.call(payload)

    def stats(self) -> ConnectorStats:
        """Counters for /metrics.

        Returns:
            A ``ConnectorStats``; a connector leaves empty what it does not have.
        """
        return ConnectorStats()


class KVConnectorWorker(ABC):
    """The worker side of a connector: moves blocks between the worker's KV tensors and the store."""

    def __init__(self, options: msgspec.Struct, storage: KVStorage, rank: int, setup: bytes):
        """
        Args:
            storage: this worker's KV tensors (its layers, its heads).
            rank: this worker's rank (a store keeps each rank's share apart).
            setup: ``KVConnector.setup``.
        """
        self.options = options
        self.storage = storage
        self.rank = rank

    @abstractmethod
    def apply(self, payload: bytes) -> None:
        """Carry out a step's payload before its forward pass.

        Args:
            payload: what ``KVConnector.take_payload`` returned for this step.
        """

    def call(self, payload: bytes) -> bytes:
        """Carry out a payload between steps (``KVConnector.call``).

        Args:
            payload: what the scheduler side sent.

        Returns:
            The answer that goes back to the scheduler side (the base: applies it and answers b"").
        """
        self.apply(payload)
        return b""

    def close(self) -> None:
        """The worker stops: finish what must outlive it (the base: nothing)."""


def kv_fingerprint(config: Config, info: Any, layout: KVCacheLayout) -> str:
    """What a stored block belongs to: the checkpoint (its files' names, sizes and times), the model's shape,
    the quant method, the KV layout and dtype, and the split across workers (hex)."""
    from conveyor.model.checkpoint import resolve_model_path

    dummy = config.model.load_format == "dummy"  # (random weights: the seed draws them)
    parts: list[Any] = [config.model.path, config.model.dtype, config.model.load_format, dummy and config.engine.seed,
                        config.quant.plugin, msgspec.to_builtins(config.quant.options),
                        msgspec.to_builtins(layout.spec), layout.block_size, info.weight_bytes,
                        config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size]
    try:
        path = resolve_model_path(config.model.path)
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        parts += [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    except Exception:  # noqa: BLE001
        pass  # (dummy weights, or a path only the workers see: the rest still names the model)
    encoded = msgspec.json.encode(parts, enc_hook=repr)
    return hashlib.blake2b(encoded, digest_size=12).hexdigest()


def build_connector(config: Config, registry: Any, executor: Any, kvcache: KVCacheManager,
                    info: Any) -> KVConnector | None:
    """The KV connector ``[connector]`` names, attached to the pool and set up on every worker (None for "none").

    Raises:
        ConfigError: it cannot run with this config (naming the key and what is allowed).
    """
    from conveyor.config import ConfigError

    spec = config.connector
    if spec.plugin == "none":
        return None
    where = f"{config.source}: [connector] plugin = {spec.plugin!r}"
    if config.engine.speculative == "draft":
        raise ConfigError(f"{where} cannot run with [engine] speculative = 'draft' (the draft model's KV is not "
                          "kept); allowed with it: speculative = 'off' or 'ngram'")
    connector = registry.build("connector", spec, kvcache.layout, kv_fingerprint(config, info, kvcache.layout),
                               lambda payload: executor.collective_rpc("kv_connector_call", payload))
    try:
        kvcache.attach(connector)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    executor.collective_rpc("init_kv_connector", connector.setup)
    return connector
