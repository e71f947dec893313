"""The command line's shortcuts: ``conveyor serve MODEL --port P`` as the config keys they stand for.

A positional that names a ``.toml`` file is a config; anything else is the model (a ``.gguf`` file, a Hugging Face
directory, or an installed alias), checked here, before anything loads, so that a wrong path is one line naming it
and what was expected.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from conveyor.config.schema import ConfigError

GGUF_MAGIC = b"GGUF"

# flag -> the key it stands for (the configuration reference names each); ``transport.http`` is the config's first
# [[transport]] table with plugin = "http"
SHORTCUTS: dict[str, str] = {
    "host": "transport.http.host",
    "port": "transport.http.port",
    "strict_requests": "transport.http.strict_requests",
    "max_model_len": "model.max_model_len",
    "chat_template": "model.chat_template",
}


def add_shortcut_args(parser: argparse.ArgumentParser) -> None:
    """The flags a vLLM or llama.cpp user types, each a key of the config (``--set`` sets any other)."""
    parser.add_argument("--host", help="interface the HTTP server listens on (transport.http.host; default "
                        "127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, help="the HTTP server's port (transport.http.port; 0 picks a free one)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the name clients use for the model, then other names they may use (model.name, "
                        "model.aliases)")
    parser.add_argument("--max-model-len", type=int, metavar="N",
                        help="longest prompt + output in tokens (model.max_model_len; default: the model's own)")
    parser.add_argument("--chat-template", metavar="FILE",
                        help="a Jinja chat template for models without one, or to replace theirs (model.chat_template)")
    parser.add_argument("--strict-requests", action="store_true", default=None,
                        help="refuse request fields that are not part of the API with a 400 naming them "
                        "(transport.http.strict_requests; default: log them once and count them on /metrics)")


def shortcut_overrides(args: argparse.Namespace, model: str | None) -> dict[str, Any]:
    """The ``--set`` overrides that a model positional and the shortcut flags stand for."""
    overrides: dict[str, Any] = {}
    if model is not None:
        overrides["model.path"] = model
    for flag, key in SHORTCUTS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides[key] = value
    names = getattr(args, "served_model_name", None)
    if names:
        overrides["model.name"], overrides["model.aliases"] = names[0], names[1:]
    return overrides


def split_target(target: str | None) -> tuple[str | None, str | None]:
    """``conveyor serve TARGET``: (config file, model), one of them None.

    Raises:
        ConfigError: TARGET is neither a config nor a model (one line naming it and what was expected).
    """
    if target is None:
        return None, None
    if target.endswith(".toml"):
        return target, None
    return None, check_model_path(target)


def check_model_path(text: str) -> str:
    """A model path as given, once it is known to be a GGUF file, a Hugging Face directory or an alias.

    Raises:
        ConfigError: it is none of those; the message names the path and what it should have been.
    """
    from conveyor.model.checkpoint import ALIASES

    if text in ALIASES:
        return text
    expected = (f"expected a .gguf file, a Hugging Face model directory (config.json, *.safetensors), an installed "
                f"model ({', '.join(ALIASES)}) or a .toml config")
    path = Path(text).expanduser()
    if not path.exists():
        raise ConfigError(f"{text}: no such file or directory; {expected}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{text}: the directory has no config.json; expected a Hugging Face model directory "
                              "(config.json, *.safetensors and tokenizer.json)")
        return text
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise ConfigError(f"{text}: cannot be read ({e.strerror}); {expected}") from None
    if magic != GGUF_MAGIC:
        raise ConfigError(f"{text}: not a GGUF file (it does not begin with {GGUF_MAGIC.decode()!r}); {expected}")
    return text
