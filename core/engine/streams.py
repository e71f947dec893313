"""One stream of outputs per in-flight request, shared by the in-process and the multi-process engine."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from conveyor.messages import RequestOutput
from conveyor.request import FinishReason, RequestRejected


class OutputStreams:
    """Routes each RequestOutput to the stream of its request; a final output closes the stream."""

    def __init__(self) -> None:
        self._streams: dict[str, MemoryObjectSendStream[RequestOutput]] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def ids(self) -> list[str]:
        return list(self._streams)

    def open(self, request_id: str) -> MemoryObjectReceiveStream[RequestOutput]:
        """A new stream for ``request_id``.

        Raises:
            RequestRejected: the id is already in flight.
        """
        if request_id in self._streams:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        # Unbounded: a slow reader must not stall the engine; max_tokens bounds it.
        send, receive = anyio.create_memory_object_stream[RequestOutput](math.inf)
        self._streams[request_id] = send
        return receive

    def route(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # its reader left already
                continue
            try:
                stream.send_nowait(output)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                del self._streams[output.request_id]
                continue
            if output.finish_reason is not None:
                stream.close()
                del self._streams[output.request_id]

    def fail_all(self, error: str, status: int) -> None:
        """End every stream with an error output (the engine is gone)."""
        self.route(
            [
                RequestOutput(request_id, finish_reason=FinishReason.ERROR.value, error=error, error_status=status)
                for request_id in list(self._streams)
            ]
        )


async def follow(
    receive: MemoryObjectReceiveStream[RequestOutput], on_early_exit: Callable[[], None]
) -> AsyncIterator[RequestOutput]:
    """Yield a request's outputs until the final one; leaving early calls ``on_early_exit`` (an abort)."""
    finished = False
    try:
        async with receive:
            async for output in receive:
                finished = output.finish_reason is not None
                yield output
    finally:
        if not finished:
            on_early_exit()
