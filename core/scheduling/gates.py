"""Admission gates: what holds a request back before the scheduler may run it.

A request whose LoRA adapter is not on the workers, or whose structured-output
grammar is still compiling, cannot be scheduled yet. The base ``Scheduler``
keeps it, in ``requests`` like every other, with the status of the gate that
holds it (``WAITING_FOR_ADAPTER``, ``WAITING_FOR_GRAMMAR``), and asks the gate
before each step whether it may go on: as vLLM's scheduler keeps requests in
``WAITING_FOR_FSM`` and checks ``max_loras`` as it schedules. The engine's
built-in gates are ``conveyor.engine.loras.LoraSlots`` and
``conveyor.engine.grammars.GrammarRequests``. ``Gated`` is the scheduler's
side: it keeps what each gate holds and moves requests on (the base
``Scheduler`` inherits it).
"""

from __future__ import annotations

from typing import ClassVar

from conveyor.messages import RequestOutput, SchedulerStats
from conveyor.request import FinishReason, Request, RequestStatus


class AdmissionGate:
    """Holds requests that may not be scheduled yet; the base ``Scheduler`` consults its gates in order.

    A request stops at the first gate that ``holds`` it as it is added (its status is then the gate's
    ``status``) and goes on when the gate's ``release`` names it: to the next gate, then the waiting
    queue. The scheduler keeps held requests in ``requests`` with the rest, so an id is checked once
    and an abort finds a request wherever it is.
    """

    status: ClassVar[RequestStatus]
    # the request's field a refusal is about (a ``SamplingParams`` field, or "model" for the adapter), sent with
    # the 400 so that a transport can name its own field
    param: ClassVar[str | None] = None

    def holds(self, request: Request) -> bool:
        """Whether the request waits here; called once, as it reaches this gate (start what it waits for)."""
        raise NotImplementedError

    def release(self, held: list[Request], idle: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The requests that go on now, and those that can never run, with why (they end with a 400).

        Args:
            held: the requests this gate holds, in arrival order.
            idle: no step is in flight on the workers.
        """
        raise NotImplementedError

    def wants_idle(self, held: list[Request]) -> bool:
        """Whether it would release a request if no step were in flight (the engine then lets the workers
        finish theirs before it submits more)."""
        return False

    def ends(self, request: Request, token: int) -> bool:
        """Whether the token a request took (one this gate let through, running) ends it here: the scheduler's
        ``update`` asks each gate after the request's own rules (end of sequence, stop ids, length) let it go on.
        Default: never (a grammar's gate ends a request whose grammar completed or refused the token)."""
        return False

    def forget(self, request: Request) -> None:
        """The request ended, wherever it was (drop what the gate keeps for it)."""


class Gated:
    """The base ``Scheduler``'s side of the gates: the requests each holds, and moving them on."""

    gates: list[AdmissionGate]
    ending_gates: list[AdmissionGate]
    # the requests each gate holds, by its status
    held: dict[RequestStatus, list[Request]]
    counters: SchedulerStats

    def _enqueue(self, request: Request) -> None:
        raise NotImplementedError

    def _remove(self, request: Request, reason: FinishReason) -> None:
        raise NotImplementedError

    def add_gate(self, gate: AdmissionGate) -> None:
        """Make every request added from now on pass ``gate`` (after those added before)."""
        self.gates.append(gate)
        self.held[gate.status] = []
        if type(gate).ends is not AdmissionGate.ends:  # (asked after every token: only those that may say yes)
            self.ending_gates.append(gate)

    def _pass_gates(self, request: Request, first: int) -> bool:
        """True when the request is queued to run, False when a gate holds it."""
        for gate in self.gates[first:]:
            if gate.holds(request):
                self._hold(request, gate)
                return False
        request.status = RequestStatus.WAITING
        self._enqueue(request)
        return True

    def _hold(self, request: Request, gate: AdmissionGate) -> None:
        """``gate`` holds the request until its ``release`` lets it go on (to the gates after it)."""
        request.status = gate.status
        self.held[gate.status].append(request)

    def release(self, idle: bool = True) -> list[RequestOutput]:
        """Move the requests the gates let go on (to the next gate, then the waiting queue); end those a gate
        refuses. The engine calls this before each ``schedule``.

        Args:
            idle: no step is in flight on the workers.

        Returns:
            The final error output (400) of each refused request, and an empty output for each request that
            passed its last gate (the engine took it: a frontend holding a response's status for it may send it).
        """
        outputs = []
        for index, gate in enumerate(self.gates):
            held = self.held[gate.status]
            if not held:
                continue
            ready, refused = gate.release(list(held), idle)
            for request in ready:
                held.remove(request)
                if self._pass_gates(request, index + 1):
                    outputs.append(RequestOutput(request.request_id))
            for request, error in refused:
                self._remove(request, FinishReason.ERROR)
                self.counters.num_rejected += 1
                outputs.append(RequestOutput(request.request_id, finish_reason=FinishReason.ERROR.value, error=error,
                                             error_status=400, num_prompt_tokens=request.num_prompt_tokens,
                                             error_param=gate.param))
        return outputs

    def wants_idle(self) -> bool:
        """Whether a gate would release a request if no step were in flight."""
        return any(held and gate.wants_idle(held) for gate, held in zip(self.gates, self.held.values()))
