"""The engine core process: EngineCore.step() in a loop behind two ZMQ sockets.

The frontend starts it with ``python -m conveyor.engine.process`` and the
addresses of two sockets it has bound: the engine PULLs requests and aborts
from the first and PUSHes outputs to the second. Messages are msgspec msgpack
(``conveyor.messages``); nothing is pickled. ZeroMQ queues what arrives
during a forward pass, so taking new requests never blocks a step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

import zmq

from conveyor.config import ConfigError, load_config
from conveyor.engine.core import EngineCore
from conveyor.messages import (
    EngineOutputs,
    EngineReady,
    EngineRequest,
    MessageType,
    RequestOutput,
    StepStats,
    decode,
    encode,
)
from conveyor.registry import PluginError
from conveyor.request import FinishReason, RequestRejected

logger = logging.getLogger("conveyor.engine")

# how long an idle engine waits for a message before checking its stop flag, ms
IDLE_POLL_MS = 200
# while a batching scheduler collects requests it steps this often, ms
COLLECT_POLL_MS = 2


class EngineProcess:
    """The engine side of the frontend <-> engine protocol."""

    def __init__(self, core: EngineCore, context: zmq.Context, input_address: str, output_address: str):
        self.core = core
        self.input = context.socket(zmq.PULL)
        self.input.connect(input_address)
        self.output = context.socket(zmq.PUSH)
        self.output.connect(output_address)
        self.stopping = False

    def send_ready(self, load_time: float) -> None:
        kv = self.core.kvcache
        stats = kv.stats()
        ready = EngineReady(
            pid=os.getpid(),
            max_model_len=self.core.max_model_len,
            num_kv_blocks=int(stats.get("num_blocks", 0)),
            block_size=int(stats.get("block_size", 0)),
            max_concurrency=kv.capacity_tokens / self.core.max_model_len,
            load_time=load_time,
        )
        self.output.send_multipart(encode(MessageType.READY, ready))

    def run(self) -> None:
        """Step until told to shut down (a SHUTDOWN message or SIGTERM)."""
        collecting = False
        while not self.stopping:
            if self.core.has_unfinished():
                timeout = COLLECT_POLL_MS if collecting else 0
            else:
                timeout = IDLE_POLL_MS
            self.take_messages(timeout)
            if self.stopping or not self.core.has_unfinished():
                continue
            outputs, stats = self.core.step()
            collecting = stats is None and not outputs
            if outputs or stats is not None:
                self.publish(outputs, stats)

    def take_messages(self, timeout_ms: int) -> None:
        """Apply every queued message, waiting up to ``timeout_ms`` for the first."""
        if not self.input.poll(timeout_ms):
            return
        rejected: list[RequestOutput] = []
        aborted = False
        while True:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                kind, body = decode(frames)
            except ValueError as e:  # a message this engine cannot read must not kill it
                logger.error("dropped a message: %s", e)
                continue
            if kind is MessageType.ADD:
                rejected.extend(self.add(body))
            elif kind is MessageType.ABORT:
                rejected.extend(self.core.abort(body))
                aborted = True
            elif kind is MessageType.SHUTDOWN:
                self.stopping = True
        if rejected or aborted:
            # after an abort the freed blocks show in the stats at once, even if no step follows
            self.publish(rejected, self.core.stats() if aborted else None)

    def add(self, message: EngineRequest) -> list[RequestOutput]:
        try:
            self.core.add_request(message)
        except RequestRejected as e:
            return [RequestOutput(message.request_id, finish_reason=FinishReason.ERROR.value, error=str(e),
                                  error_status=e.status)]
        return []

    def publish(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        self.output.send_multipart(encode(MessageType.OUTPUTS, EngineOutputs(outputs, stats)))

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.engine.process")
    parser.add_argument("--config", default=None)
    parser.add_argument("--overrides", default="{}", help="JSON object of section.key -> value")
    parser.add_argument("--input", required=True, help="address to PULL requests from")
    parser.add_argument("--output", required=True, help="address to PUSH outputs to")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="engine: %(message)s", stream=sys.stderr)
    # Ctrl-C reaches the whole process group; the frontend decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start = time.perf_counter()
    try:
        core = EngineCore(load_config(args.config, json.loads(args.overrides)))
    except (ConfigError, PluginError, FileNotFoundError, ImportError) as e:
        print(f"engine: error: {e}", file=sys.stderr)
        return 2
    context = zmq.Context()
    engine = EngineProcess(core, context, args.input, args.output)

    def stop(signum, frame) -> None:
        engine.stopping = True

    signal.signal(signal.SIGTERM, stop)
    engine.send_ready(time.perf_counter() - start)
    try:
        engine.run()
    finally:
        engine.close()
        context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
