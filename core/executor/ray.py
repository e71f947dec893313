"""``ray``: the engine's workers as Ray actors, on one machine or across a cluster.

``[parallel] ray_address`` joins a running cluster (``"auto"`` or
``"HOST:PORT"``: ``ray start --head`` on one machine, ``ray start
--address`` on the others) or, when empty, starts a local Ray instance
(dashboard off) that ends with the engine. Each pipeline stage's
tensor-parallel group is one placement group packed on one node
(``STRICT_PACK``: its all-reduces stay inside the machine); stages may land
on different nodes. The workers meet for torch.distributed at rank 0's node
address. Calls and results cross as the same msgpack bytes the ``mp``
executor sends (``conveyor.worker.rpc``); Ray only carries bytes. Each
actor runs its calls in order, so up to ``pipeline_parallel_size`` steps are
in flight. An actor that dies raises ``ExecutorError`` naming its rank: the
engine process exits and is restarted with new actors.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from conveyor.config import Config, ConfigError, encode_config
from conveyor.perf.cpus import cpu_limit
from conveyor.executor import ExecutorError, PipelinedExecutor, decode_result, log_workers
from conveyor.registry import PluginRegistry
from conveyor.worker import rpc

logger = logging.getLogger("conveyor")

# seconds to wait for the cluster to find room for the workers
PLACEMENT_TIMEOUT = 120.0


class RayWorker:
    """The actor: a ``Worker`` answering encoded calls."""

    def start(self, config: bytes, rank: int, init_method: str, local_rank: int) -> bytes:
        from conveyor.worker.process import start_worker

        logging.basicConfig(level=logging.INFO, format=f"worker {rank}: %(message)s")
        self.rank = rank
        self.worker, hello = start_worker(config, rank, init_method, local_rank)
        return hello

    def call(self, data: bytes) -> bytes:
        from conveyor.worker.process import answer

        return answer(self.worker, self.rank, data)[0]

    def rendezvous(self) -> str:
        """A free TCP address on this actor's node, for torch.distributed."""
        import ray

        from conveyor.executor.mp import free_port

        host = ray.util.get_node_ip_address()
        return f"tcp://{host}:{free_port(host)}"


class RayExecutor(PipelinedExecutor):
    """Workers as Ray actors placed by placement groups."""

    name = "ray"

    def __init__(self, config: Config, registry: PluginRegistry):
        super().__init__(config, registry)
        try:
            import ray
        except ImportError:
            raise ConfigError(
                f"{config.source}: [parallel] executor = 'ray' needs Ray: pip install 'conveyor-serve[ray]'"
            ) from None
        self._ray = ray
        parallel = config.parallel
        self.world_size = parallel.world_size
        self._started_ray = False
        self._groups: list[Any] = []
        self.actors: list[Any] = []
        try:
            self._start_ray(parallel.ray_address)
            self._start_actors()
        except BaseException:
            self.shutdown()
            raise

    def _start_ray(self, address: str) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        if address:
            self._check_reachable(address)
            logger.info("joining the Ray cluster at %s", address)
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
        else:
            # a local instance on 127.0.0.1, with a logical CPU per worker at least; "local", because Ray
            # would otherwise join the cluster RAY_ADDRESS or the last `ray start` on this machine names
            cpus = max(cpu_limit().usable, self.world_size)
            logger.info("starting a local Ray instance (%d CPUs, dashboard off)", cpus)
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING,
                     log_to_driver=True, _node_ip_address="127.0.0.1")
        self._started_ray = not address

    def _check_reachable(self, address: str) -> None:
        """Refuse at once an address nothing answers on (Ray itself would retry without end)."""
        if address == "auto":
            return
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{self.config.source}: [parallel] ray_address = {address!r}: no Ray cluster answers there ({e}); "
                "start one with `ray start --head`, or use \"\" for a local instance"
            ) from None

    def _start_actors(self) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        parallel = self.config.parallel
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        gpu = self.config.model.device == "cuda" or (self.config.model.device == "auto" and _cluster_has_gpus(ray))
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        actor_class = ray.remote(num_gpus=1 if gpu else 0, num_cpus=1)(RayWorker)
        for stage in range(pp):
            group = placement_group([bundle] * tp, strategy="STRICT_PACK", name="")
            self._groups.append(group)
            ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT)
            if not ready:
                raise ExecutorError(
                    f"Ray found no node with room for pipeline stage {stage}'s {tp} workers of {bundle} each within "
                    f"{PLACEMENT_TIMEOUT:.0f} s (a tensor-parallel group runs on one node); cluster resources: "
                    f"{ray.cluster_resources()}"
                )
            for index in range(tp):
                strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
                self.actors.append(actor_class.options(scheduling_strategy=strategy).remote())
        init_method = self._get(self.actors[0].rendezvous.remote(), 0, "rendezvous")
        data = encode_config(self.config)
        # every worker must be in torch.distributed's rendezvous at once: start them all, then wait
        hellos = [actor.start.remote(data, rank, init_method, rank % tp if gpu else 0)
                  for rank, actor in enumerate(self.actors)]
        log_workers(self._results(hellos, "start"))

    def _get(self, ref: Any, rank: int, method: str) -> Any:
        try:
            return self._ray.get(ref)
        except self._ray.exceptions.RayActorError as e:
            raise ExecutorError(f"worker rank {rank} (a Ray actor) died during {method}: {e}") from None

    def _send(self, data: bytes) -> list[Any]:
        return [actor.call.remote(data) for actor in self.actors]

    def _results(self, refs: list[Any], method: str) -> list[Any]:
        replies = [rpc.decode_reply(self._get(ref, rank, method)) for rank, ref in enumerate(refs)]
        return [decode_result(method, reply) for reply in replies]

    def shutdown(self) -> None:
        """Kill the actors and free their placement groups; stop Ray if this executor started it."""
        ray = self._ray
        from ray.util.placement_group import remove_placement_group

        for release, things in ((ray.kill, self.actors), (remove_placement_group, self._groups)):
            for thing in things:
                try:
                    release(thing)
                except Exception as e:  # noqa: BLE001 - already gone (a dead actor, a stopped cluster)
                    logger.debug("Ray shutdown: %s", e)
        self.actors, self._groups = [], []
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False


def _cluster_has_gpus(ray) -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0
