"""A worker process of the ``mp`` executor: one ``Worker`` behind a ZeroMQ DEALER socket.

The executor (``conveyor.executor.mp``) starts it with ``python -m
conveyor.worker.process``, writes the validated config to its stdin
(msgpack), and names its rank, the executor's ROUTER socket and where the
workers meet for torch.distributed. The worker's first message says it
started, or why it could not; then it answers calls (``conveyor.worker.rpc``)
in the order they come. It dies with its parent (named by ``--parent``, so
that a parent gone while this process still imported is noticed): Linux's
parent-death signal, and a check of the parent's pid while idle elsewhere.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys

import zmq

from conveyor.config import ConfigError, decode_config
from conveyor.worker import rpc

logger = logging.getLogger("conveyor.worker")

# how long an idle worker waits for a call before checking that its parent lives, ms
IDLE_POLL_MS = 1000


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no orphans after a crash)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def describe(e: BaseException) -> tuple[str, str]:
    """An exception as (error kind, one line)."""
    if isinstance(e, ConfigError):
        return "config", str(e)
    return "error", f"{type(e).__name__}: {e}"


def answer(worker, rank: int, data: bytes) -> tuple[bytes, str]:
    """Run one call on ``worker``: the reply, and the method's name."""
    seq, method, args = rpc.decode_call(data)
    try:
        result = getattr(worker, method)(*args)
    except Exception as e:
        logger.exception("rank %d: %s failed", rank, method)
        return rpc.encode_reply(seq, rank, None, *describe(e)), method
    return rpc.encode_reply(seq, rank, result), method


def start_worker(data: bytes, rank: int, init_method: str, local_rank: int):
    """A Worker from the encoded config, and its first reply: its pid, or why it could not start."""
    try:
        from conveyor.worker.worker import Worker

        config = decode_config(data)
        worker = Worker(config, config._registry, rank, init_method, local_rank)
    except Exception as e:
        logger.exception("rank %d could not start", rank)
        return None, rpc.encode_reply(rpc.HELLO, rank, None, *describe(e))
    return worker, rpc.encode_reply(rpc.HELLO, rank, os.getpid())


def serve(worker, sock: zmq.Socket, rank: int, parent: int) -> None:
    """Answer calls until ``shutdown``, or until the parent is gone."""
    while True:
        if not sock.poll(IDLE_POLL_MS):
            if os.getppid() != parent:
                logger.error("rank %d: the engine process is gone; exiting", rank)
                return
            continue
        reply, method = answer(worker, rank, sock.recv())
        sock.send(reply)
        if method == "shutdown":
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.worker.process",
                                     description="an engine's worker; reads its config (msgpack) from stdin")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, default=0, help="this worker's number on its machine (its GPU)")
    parser.add_argument("--executor", required=True, help="the executor's ROUTER socket address")
    parser.add_argument("--init-method", required=True, help="torch.distributed rendezvous, tcp://HOST:PORT")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--parent", type=int, default=0,
                        help="the engine process's pid (default: this process's parent as it starts)")
    args = parser.parse_args(argv)
    parent = args.parent or os.getppid()
    die_with_parent()
    # an engine that died before the death signal was asked for (while this process imported) sends none
    if os.getppid() != parent:
        print(f"worker {args.rank}: the engine process (pid {parent}) is gone; exiting", file=sys.stderr)
        return 1
    logging.basicConfig(level=args.log_level, format=f"worker {args.rank}: %(message)s", stream=sys.stderr)
    # the engine process decides when its workers stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, str(args.rank).encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(args.executor)
    worker, hello = start_worker(sys.stdin.buffer.read(), args.rank, args.init_method, args.local_rank)
    sock.send(hello)
    if worker is None:
        sock.close()
        context.term()
        return 2
    try:
        serve(worker, sock, args.rank, parent)
    finally:
        sock.close()
        context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
