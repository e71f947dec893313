"""Admission gates: what holds a request back before the scheduler may run it.

A request whose LoRA adapter is not on the workers, or whose structured-output
grammar is still compiling, cannot be scheduled yet. The base ``Scheduler``
keeps it, in ``requests`` like every other, with the status of the gate that
holds it (``WAITING_FOR_ADAPTER``, ``WAITING_FOR_GRAMMAR``), and asks the gate
before each step whether it may go on: as vLLM's scheduler keeps requests in
``WAITING_FOR_FSM`` and checks ``max_loras`` as it schedules. The engine's
built-in gates are ``conveyor.engine.loras.LoraSlots`` and
``conveyor.engine.grammars.GrammarRequests``.
"""

from __future__ import annotations

from typing import ClassVar

from conveyor.request import Request, RequestStatus


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

    def forget(self, request: Request) -> None:
        """The request ended, wherever it was (drop what the gate keeps for it)."""
