"""The real server for end-to-end tests: ``conveyor serve`` on free ports of 127.0.0.1."""

from __future__ import annotations

from conveyor.bench.server import Server

__all__ = ["Server", "http_config"]


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
