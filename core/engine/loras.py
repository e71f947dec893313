"""Which LoRA adapters the workers hold, in which slot, and the requests waiting for theirs.

The workers have ``[lora] max_loras`` slots. A request whose adapter is held
goes straight on; one whose adapter is not waits here until a slot is free or
can be freed (the least recently used adapter that no unfinished request
runs under), then every worker loads the adapter from its directory. An
adapter that fails to load fails the requests for it with a 400 that says
why; the workers go on.
"""

from __future__ import annotations

from collections import OrderedDict

from conveyor.executor import Executor
from conveyor.request import Request


class LoraSlots:
    def __init__(self, executor: Executor, max_loras: int):
        self.executor = executor
        self.max_loras = max_loras
        # adapter id -> its slot, least recently used first
        self.held: OrderedDict[int, int] = OrderedDict()
        # requests whose adapter is not held yet, in arrival order
        self.waiting: list[Request] = []

    def slot(self, request: Request) -> int:
        """The workers' slot of the request's adapter (-1: none)."""
        return -1 if request.lora is None else self.held[request.lora.id]

    def ready(self, request: Request) -> bool:
        """Whether the request can go on now: no adapter, or one the workers hold (now the most recently used)."""
        if request.lora is None:
            return True
        if request.lora.id not in self.held:
            return False
        self.held.move_to_end(request.lora.id)
        return True

    def loadable(self, in_use: set[int]) -> bool:
        """Whether a waiting request can go on now (its adapter is held, or a slot can take it)."""
        return bool(self.waiting) and (
            any(r.lora.id in self.held for r in self.waiting) or self._free_slot(in_use, evict=False) is not None)

    def take(self, in_use: set[int]) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Load the adapters the waiting requests need where slots allow (call with no step in flight).

        Args:
            in_use: ids of the adapters that unfinished requests run under (their slots stay).

        Returns:
            The requests whose adapter is now held, and those whose adapter failed to load, with why.
        """
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        errors: dict[int, str] = {}
        still: list[Request] = []
        for request in self.waiting:
            adapter = request.lora
            if adapter.id in errors:
                failed.append((request, errors[adapter.id]))
                continue
            if adapter.id not in self.held:
                slot = self._free_slot(in_use | {r.lora.id for r in ready}, evict=True)
                if slot is None:
                    still.append(request)
                    continue
                problems = [e for e in self.executor.collective_rpc("add_lora", slot, adapter.path) if e]
                if problems:
                    errors[adapter.id] = f"the LoRA adapter {adapter.name!r} cannot be loaded: {problems[0]}"
                    failed.append((request, errors[adapter.id]))
                    continue
                self.held[adapter.id] = slot
            self.held.move_to_end(adapter.id)
            ready.append(request)
        self.waiting = still
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
