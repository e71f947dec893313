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
examples/conveyor-kv-sqlite is a complete connector in one short file.

The contract, in the order a request meets it:

- A request is added: ``holds`` may keep it at the gate (status
  ``WAITING_FOR_KV``); ``release``, called before each step, lets it go on.
  (Gates before this one, an adapter loading or a grammar compiling, come
  first: ``holds`` comes once they let the request go.)
- At admission, after the pool's own prefix match of ``n`` blocks, the KV
  cache manager passes the request and the digests of its next full blocks
  to ``lookup``; for each of the first ``lookup(...)`` of them it allocates a
  block and calls ``load(digest, block)``. ``lookup`` may come several times
  for one request: again when memory was short (the request waits, nothing
  was loaded), when it comes back after a preemption (status ``PREEMPTED``),
  and after each ``None``. It does not come where the pool holds every full
  block of the request, nor for a request that computes every prompt token
  (prompt logprobs, mean pooling). ``lookup`` may answer None: the scheduler
  then holds the request at the gate while the connector fetches its blocks
  (from somewhere slow), and asks again once ``release`` lets it go; it may
  answer None again then (the request goes back to the gate: nothing stops a
  connector that never answers a number). The request's first step computes
  after the loaded blocks: the worker side must have filled them before that
  step's forward pass (the step carries ``take_payload()``).
- A loaded block is the pool's at once: other requests share it, and it is
  never offered to ``save`` (nor is a block the pool matched itself). When a
  block of a request is full and its tokens computed, the manager calls
  ``save(digest, block)``, once, unless the pool holds that digest already.
  The same digest comes to ``save`` again after the pool has evicted it and a
  request computed it again (a store that holds it keeps its copy or takes
  the new one). A block's contents are final once the steps already
  submitted have run; the block is not reused before the next step the
  engine submits, which carries the payload; when the engine goes idle
  instead, it calls ``flush``, which carries it out at once.
- A block the worker side could not fill (a store that lost it, a read that
  failed its checksum) is reported by ``KVConnectorWorker.apply``: it returns
  the device blocks it could not load, and a block any worker could not load
  is a failed one. The engine then forgets the block in the pool, calls
  ``load_failed(digest, block)`` (drop your copy, or stop counting it in
  ``lookup``), gives the requests of that step that hold the block no token
  from it, and preempts them: they start over and compute from that block on
  (the pool asks for none of it again until it has computed the block and
  offered it to ``save``). So that no other step reads a block before its
  load is known to have worked, nothing is submitted on top of a step that
  loads blocks (under async scheduling or pipeline parallelism that step
  runs alone).
- A request ends (finished, aborted, refused by a gate, failed): ``forget``
  comes once for every request the scheduler took, wherever it is, whether or
  not it ever reached this gate (not for one ``add`` refused, nor for those
  unfinished when the engine stops: ``close`` comes then).
- A request prefilled by another engine (prefill/decode disaggregation)
  carries ``request.kv_transfer``: the other engine's connector saves its
  prompt's blocks, and this one may hold it at the gate until they have
  come (``holds``, ``release``), for at most ``kv_transfer.timeout`` seconds.

Where each part runs. The scheduler side's methods run on the engine core's
thread: ``holds`` as a request reaches the gate, ``release`` before every
step while the gate holds a request, ``lookup``, ``load`` and ``save`` while
the scheduler builds a step (``save`` also as requests end or are
preempted), ``take_payload`` once per step built, after them, ``flush`` when
no step is in flight and no request is left, and ``stats`` with every step's
stats. There is one worker side per worker: ``tensor_parallel_size *
pipeline_parallel_size`` of them, numbered ``rank = pp_rank *
tensor_parallel_size + tp_rank`` (the ``rank`` they are built with), each
over its worker's ``KVStorage``: its pipeline stage's layers and its share
of the KV heads, so each stores its own share of every block, and a block is
whole only when every rank has its share. Data-parallel replicas and
prefill/decode engines are engines of their own, each with a scheduler side
and ranks from 0. ``apply`` runs on every worker, in the worker's process
(the engine core's with one worker, on a thread of its own where async
scheduling may be on; a worker process or Ray actor otherwise), before the
forward pass of each step whose payload is not empty, in step order (a step
built while the last one runs is applied after that one's forward pass).
``call`` runs the worker side's ``call`` on every worker at once, and only
while no step is in flight; it returns their answers by rank (so their
number is ``len(call(...))``).

What an exception does. One raised by a scheduler side's method, or by a
worker side's ``call``, stops the engine: a server's engine process exits, its
requests in flight fail with 503 and it is restarted (up to its restart
limit); in-process (``LLM``, ``conveyor generate``) the exception reaches the
caller. One raised by ``apply`` fails its step: with the worker in the engine
core's process (``uniproc``) the step's requests end with an error, the
blocks it loaded count as failed, and the engine goes on; with worker
processes (``mp``, ``ray``) the engine is restarted as above. A block that
cannot be loaded is not an exception: return it from ``apply``.

A block's digest is the prefix cache's: its tokens chained to every token
before it and the request's cache salt (its LoRA adapter), so equal digests
hold equal keys and values for one model. ``fingerprint`` names the model,
quant method, KV dtype and layout a connector's blocks belong to: a store that
outlives the engine keys its blocks by both (and by rank).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from conveyor.scheduling.gates import AdmissionGate
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
        """Let held requests go on (called before each step while this gate holds any).

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
            request: the request (status ``WAITING``, or ``PREEMPTED`` when it comes back).
            digests: its next full blocks, in order, after those the pool holds (up to one whose load failed and
                that the pool has not computed since; possibly none).

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

    def load_failed(self, digest: bytes, block: int) -> None:
        """The worker side could not fill a block ``load`` asked for (``KVConnectorWorker.apply`` said so, or the step
        failed). The pool has forgotten it, and the requests that hold it compute it again. Drop or mark your copy
        (the base: nothing; the pool will not ask for this digest again until it has computed the block and
        offered it to ``save``).

        Args:
            digest: the block's digest.
            block: the device block ``load`` was given for it.
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
        """Built in every worker once its pool exists, on the thread that runs its steps.

        Args:
            options: the scheduler side's ``Options`` instance.
            storage: this worker's KV tensors (its pipeline stage's layers, its share of the KV heads).
            rank: this worker's rank, 0 .. ``tensor_parallel_size * pipeline_parallel_size`` - 1 (a store keeps
                each rank's share of a block apart).
            setup: ``KVConnector.setup``.
        """
        self.options = options
        self.storage = storage
        self.rank = rank

    @abstractmethod
    def apply(self, payload: bytes) -> list[int] | None:
        """Carry out a step's payload before its forward pass.

        Args:
            payload: what ``KVConnector.take_payload`` returned for this step.

        Returns:
            The device blocks of the payload's loads that could not be filled (missing, unreadable, failed
            checks); None or []: all were. The engine does not serve them: it recomputes the requests that hold
            them (see the module's contract).
        """

    def call(self, payload: bytes) -> bytes:
        """Carry out a payload between steps (``KVConnector.call``).

        Args:
            payload: what the scheduler side sent.

        Returns:
            The answer that goes back to the scheduler side (the base: applies it and answers b""; the engine sends
            loads in step payloads only, so what ``apply`` reports is not needed here).
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
