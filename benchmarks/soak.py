"""Soak: a real server under a mixed, partly hostile stream of requests for a set time, then its books checked.

    python benchmarks/soak.py [--minutes 10] [--clients 12] [--set KEY=VALUE ...]

Streams, completions, streams dropped by their clients, requests their
clients stop waiting for, malformed bodies and bursts past max_waiting, all
at once, on the default model (``conveyor.bench.soak`` says what is sent
and what is checked). Prints a table of how requests ended and of the
checks; exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from conveyor.bench.soak import format_report, soak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = soak(Path(tmp), seconds=args.minutes * 60, clients=args.clients, seed=args.seed,
                      progress=lambda line: print(line, flush=True), overrides=args.set)
    print(format_report(report))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
