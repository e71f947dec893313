"""Which LoRA adapters the workers hold, in which slot: the scheduler's gate for requests waiting for theirs.

The workers have ``[lora] max_loras`` slots. A request whose adapter is held
goes straight on; one whose adapter is not waits at this gate
(``WAITING_FOR_ADAPTER``) until a slot is free or can be freed (the least
recently used adapter that no unfinished request runs under), then every
worker loads the adapter from its directory, between steps. An adapter that
fails to load fails the requests for it with a 400 that says why; the
workers go on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from conveyor.executor import Executor
from conveyor.scheduling.gates import AdmissionGate
from conveyor.request import Request, RequestStatus


class LoraSlots(AdmissionGate):
    status = RequestStatus.WAITING_FOR_ADAPTER
    param = "model"

    def __init__(self, executor: Executor, max_loras: int, requests: Mapping[str, Request]):
        """
        Args:
            requests: every unfinished request (the scheduler's): the adapters they run under keep their slots.
        """
        self.executor = executor
        self.max_loras = max_loras
        self.requests = requests
        # adapter id -> its slot, least recently used first
        self.held: OrderedDict[int, int] = OrderedDict()

    def slot(self, request: Request) -> int:
        """The workers' slot of the request's adapter (-1: none)."""
        return -1 if request.lora is None else self.held[request.lora.id]

    def holds(self, request: Request) -> bool:
        """Whether the request waits for its adapter (one it finds held becomes the most recently used)."""
        if request.lora is None:
            return False
        if request.lora.id not in self.held:
            return True
        self.held.move_to_end(request.lora.id)
        return False

    def _in_use(self) -> set[int]:
        """The adapters of the requests past this gate."""
        return {r.lora.id for r in self.requests.values() if r.lora is not None and r.status != self.status}

    def wants_idle(self, held: list[Request]) -> bool:
        """Whether a held request could go on now (its adapter is held, or a slot can take it)."""
        return any(r.lora.id in self.held for r in held) or self._free_slot(self._in_use(), evict=False) is not None

    def release(self, held: list[Request], idle: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Load the adapters the held requests need, where slots allow (only while no step is in flight: the
        workers load between steps).

        Returns:
            The requests whose adapter is now held, and those whose adapter failed to load, with why.
        """
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        if not idle:
            return ready, failed
        in_use = self._in_use()
        errors: dict[int, str] = {}
        for request in held:
            adapter = request.lora
            if adapter.id in errors:
                failed.append((request, errors[adapter.id]))
                continue
            if adapter.id not in self.held:
                slot = self._free_slot(in_use | {r.lora.id for r in ready}, evict=True)
                if slot is None:
                    continue
                problems = [e for e in self.executor.collective_rpc("add_lora", slot, adapter.path) if e]
                if problems:
                    errors[adapter.id] = f"the LoRA adapter {adapter.name!r} cannot be loaded: {problems[0]}"
                    failed.append((request, errors[adapter.id]))
                    continue
                self.held[adapter.id] = slot
            self.held.move_to_end(adapter.id)
            ready.append(request)
        return ready, failed

    def _free_slot(self, in_use: set[int], evict: bool) -> int | None:
        """A slot no held adapter uses, else (``evict``: freed) that of the least recently used adapter not in use."""
        used = set(self.held.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        for adapter_id, slot in self.held.items():
            if adapter_id not in in_use:
                if evict:
                    del self.held[adapter_id]
                return slot
        return None
