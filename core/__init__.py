"""Conveyor: an LLM inference server with continuous batching and pluggable policies."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "Completion", "Config", "SamplingParams", "load_config"]

if TYPE_CHECKING:
    from conveyor.config import Config, load_config
    from conveyor.llm import LLM, Completion
    from conveyor.sampling import SamplingParams


def __getattr__(name: str):
    # Lazy, so that `import conveyor.config` does not pull in torch.
    if name in ("LLM", "Completion"):
        from conveyor import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from conveyor.sampling import SamplingParams

        return SamplingParams
    if name in ("Config", "load_config"):
        from conveyor import config

        return getattr(config, name)
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
