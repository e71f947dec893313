"""A ``conveyor serve`` subprocess on free ports, for benchmarks and end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import httpx

from conveyor.perf.readings import metric_samples

STARTUP_TIMEOUT = 300.0


class Server:
    """``conveyor serve CONFIG`` with its output collected.

    Args:
        config: the TOML text; ``[[transport]]`` tables should use port 0
            (HTTP) or ``tcp://127.0.0.1:*`` (ZMQ) so that free ports are taken.
        tmp: a directory for the config file.
        env: extra environment variables.
        echo: also print the server's output as it comes (progress of long runs).
        overrides: ``section.key=value`` strings passed as ``--set``.
        command: the command that starts the server instead (``conveyor serve MODEL --port 0``, ``make serve``);
            it runs in a process group of its own, which ``stop`` signals whole.
    """

    def __init__(
        self,
        config: str,
        tmp: Path,
        env: dict[str, str] | None = None,
        echo: bool = False,
        overrides: list[str] | None = None,
        command: list[str] | None = None,
    ):
        self.echo = echo
        self.overrides = overrides or []
        self.command = command
        self.config_path = tmp / "server.toml"
        self.config_path.write_text(config)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.lines: list[str] = []
        self.urls: list[str] = []
        self.process: subprocess.Popen | None = None

    def launch(self) -> Server:
        """Starts the server process and returns at once (its output collected into ``lines`` as it comes)."""
        command = self.command or [sys.executable, "-m", "conveyor", "serve", str(self.config_path)]
        self.process = subprocess.Popen(
            command + [arg for override in self.overrides for arg in ("--set", override)],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=self.command is not None,
        )
        threading.Thread(target=self._collect, daemon=True).start()
        return self

    def start(self) -> Server:
        """Starts the server and returns once every transport listens (the engine ready)."""
        self.launch()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        expected = max(1, len(tomllib.loads(self.config_path.read_text()).get("transport", [])))
        while len(self.urls) < expected:
            if self.process.poll() is not None:
                raise RuntimeError("the server exited during start-up:\n" + self.output)
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start in time:\n" + self.output)
            time.sleep(0.05)
        return self

    def _collect(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            line = line.rstrip("\n")
            match = re.match(r"Listening on (\S+)", line)
            if match:
                self.urls.append(match.group(1))
            self.lines.append(line)
            if self.echo:
                print(f"  | {line}", file=sys.stderr, flush=True)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def url(self, scheme: str) -> str:
        """The first listening address that starts with ``scheme`` (http, tcp)."""
        return next(u for u in self.urls if u.startswith(scheme))

    @property
    def http(self) -> str:
        return self.url("http")

    @property
    def engine_pid(self) -> int:
        """The engine process now (the latest to report ready)."""
        return int(re.findall(r"engine process (\d+) ready", self.output)[-1])

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics: the sum over the label sets that have ``labels``."""
        samples = metric_samples(httpx.get(f"{self.http}/metrics").text)
        values = [
            s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        if not values:
            raise KeyError(f"{name}{labels or ''} not in /metrics")
        return sum(values)

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server and return its exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            if self.command is not None:  # (make, and the server it started)
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode
