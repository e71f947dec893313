"""The engine core process: EngineCore.step() in a loop behind two ZMQ sockets.

The frontend (``conveyor.engine.mp_client``) starts it with ``python -m
conveyor.engine.process``, writes the validated config to its stdin
(msgpack), and gives it the addresses of two sockets it has bound: the
engine PULLs requests and aborts from the first and PUSHes outputs to the
second. Messages are msgspec msgpack (``conveyor.messages``); nothing is
pickled. ZeroMQ queues what arrives during a forward pass, so taking new
requests never blocks a step. If the engine cannot start, its one message
is FAILED with the reason. An engine whose frontend has exited (killed,
without the SHUTDOWN it would have sent) stops by itself: it checks between
steps, and while a send to the frontend waits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import zmq

from conveyor.config import ConfigError, decode_config
from conveyor.engine.core import EngineCore
from conveyor.executor import ExecutorError
from conveyor.messages import EngineOutputs, MessageType, RequestOutput, StepStats, decode, encode
from conveyor.registry import PluginError

logger = logging.getLogger("conveyor.engine")

# how long an idle engine waits for a message before checking its stop flag, ms
IDLE_POLL_MS = 200
# how long a send to the frontend waits (its queue full) before the engine checks that the frontend is there, ms
SEND_TIMEOUT_MS = 1000
# errors that are the user's to fix: the reason goes to the frontend in one line
STARTUP_ERRORS = (ConfigError, PluginError, FileNotFoundError, ImportError, ValueError, ExecutorError)


class EngineProcess:
    """The engine side of the frontend <-> engine protocol."""

    def __init__(self, core: EngineCore, context: zmq.Context, input_address: str, output_address: str, parent: int):
        self.core = core
        self.input = context.socket(zmq.PULL)
        self.input.connect(input_address)
        self.output = context.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self.output.connect(output_address)
        self.stopping = False
        # the frontend that started this engine (a process whose parent exits is given another one)
        self.parent = parent

    def frontend_gone(self) -> bool:
        """Whether the frontend has exited; the engine then stops (nobody reads its outputs or sends it work)."""
        if os.getppid() == self.parent:
            return False
        if not self.stopping:
            logger.warning("the frontend (pid %d) is gone; the engine stops", self.parent)
            self.stopping = True
        return True

    def send_ready(self, load_time: float) -> None:
        self.send(encode(MessageType.READY, self.core.ready(load_time)))

    def run(self) -> None:
        """Step until told to shut down (a SHUTDOWN message or SIGTERM), or until the frontend is gone."""
        while not self.stopping and not self.frontend_gone():
            timeout = self.core.poll_timeout()
            # an idle engine still looks at its stop flag now and then
            self.take_messages(IDLE_POLL_MS if timeout is None else round(timeout * 1000))
            if self.stopping or not self.core.has_unfinished():
                continue
            outputs, stats = self.core.step()
            if outputs or stats is not None:
                self.publish(outputs, stats)

    def take_messages(self, timeout_ms: int) -> None:
        """Apply every queued message, waiting up to ``timeout_ms`` for the first."""
        if not self.input.poll(timeout_ms):
            return
        messages: list[tuple[MessageType, object]] = []
        while True:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                messages.append(decode(frames))
            except ValueError as e:  # a message this engine cannot read must not kill it
                logger.error("dropped a message: %s", e)
        self.stopping = self.stopping or any(kind is MessageType.SHUTDOWN for kind, _ in messages)
        taken = self.core.apply(messages)
        if taken is not None:
            self.publish(taken.outputs, taken.stats)

    def publish(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        self.send(encode(MessageType.OUTPUTS, EngineOutputs(outputs, stats)))

    def send(self, frames: list[bytes]) -> None:
        """Send to the frontend, waiting while its queue is full; given up once the engine is told to stop or the
        frontend is gone (a blocked send would otherwise never see either)."""
        while True:
            try:
                self.output.send_multipart(frames)
                return
            except zmq.Again:
                if self.stopping or self.frontend_gone():
                    return

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.engine.process",
                                     description="the engine core; reads its config (msgpack) from stdin")
    parser.add_argument("--input", required=True, help="address to PULL requests from")
    parser.add_argument("--output", required=True, help="address to PUSH outputs to")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--parent", type=int, default=0,
                        help="the frontend's pid (default: this process's parent as it starts); the engine stops "
                             "once that process is gone")
    args = parser.parse_args(argv)
    # Named by the frontend: one killed while this engine still loads (SIGTERM or SIGKILL before its signal
    # handling starts) would otherwise have passed this process to another parent before it looked.
    parent = args.parent or os.getppid()
    logging.basicConfig(level=args.log_level, format="engine: %(message)s", stream=sys.stderr)
    # Ctrl-C reaches the whole process group; the frontend decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start = time.perf_counter()
    context = zmq.Context()
    try:
        core = EngineCore(decode_config(sys.stdin.buffer.read()))
    except STARTUP_ERRORS as e:
        failed = context.socket(zmq.PUSH)
        failed.connect(args.output)
        failed.send_multipart(encode(MessageType.FAILED, str(e)))
        failed.close(linger=5000)
        context.term()
        return 2
    engine = EngineProcess(core, context, args.input, args.output, parent)

    def stop(signum, frame) -> None:
        engine.stopping = True

    signal.signal(signal.SIGTERM, stop)
    engine.send_ready(time.perf_counter() - start)
    try:
        engine.run()
    except ExecutorError as e:
        logger.error("the workers failed: %s; the engine exits (and is restarted)", e)
        return 1
    finally:
        core.shutdown()
        engine.close()
        context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
