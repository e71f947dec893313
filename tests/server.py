"""A real ``conveyor serve`` in a subprocess, on free ports of 127.0.0.1, for end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 180.0


class Server:
    """``conveyor serve CONFIG`` with its output collected.

    Args:
        config: the TOML text; ``[[transport]]`` tables should use port 0
            (HTTP) or ``tcp://127.0.0.1:*`` (ZMQ) so that free ports are taken.
        tmp: a directory for the config file.
        env: extra environment variables.
    """

    def __init__(self, config: str, tmp: Path, env: dict[str, str] | None = None):
        self.config_path = tmp / "server.toml"
        self.config_path.write_text(config)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.lines: list[str] = []
        self.urls: list[str] = []
        self.process: subprocess.Popen | None = None

    def start(self) -> Server:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "conveyor", "serve", str(self.config_path)],
            cwd=REPO,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._collect, daemon=True).start()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        expected = max(1, self.config_path.read_text().count("[[transport]]"))
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

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def url(self, scheme: str) -> str:
        """The first listening address that starts with ``scheme`` (http, tcp)."""
        return next(u for u in self.urls if u.startswith(scheme))

    @property
    def http(self) -> str:
        return self.url("http")

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics: the sum over the label sets that have ``labels``."""
        text = httpx.get(f"{self.http}/metrics").text
        wanted = [f'{key}="{value}"' for key, value in labels.items()]
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") and all(w in line.split("}", 1)[0] for w in wanted)
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
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def http_config(**server: object) -> str:
    """A config serving HTTP on a free port, with extra ``[server]`` keys."""
    lines = ["[server]", "status_interval = 1.0"] + [f"{k} = {_toml(v)}" for k, v in server.items()]
    return "\n".join(lines) + '\n\n[[transport]]\nplugin = "http"\nport = 0\n'


def _toml(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
