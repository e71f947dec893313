"""Conveyor: an LLM inference server with continuous batching and pluggable policies."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# Idle OpenMP threads sleep rather than spin between parallel regions, unless the environment says otherwise.
# Where another process shares the cores (a container's CPU quota, a noisy neighbour), a spinning thread takes
# time from the one doing the work: 64 mixed chats offline on 2 cores beside a process keeping one core busy ran
# 1.9x slower than alone this way, 2.7x spinning, with no change alone (docs/performance.md). It must be set
# before torch loads its OpenMP runtime: importing conveyor first does that (the CLI, the workers).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
__all__ = ["LLM", "Completion", "Config", "SamplingParams", "load_config"]

if TYPE_CHECKING:
    from conveyor.config import Config, load_config
    from conveyor.entrypoints.llm import LLM, Completion
    from conveyor.sampling import SamplingParams


def __getattr__(name: str):
    # Lazy, so that `import conveyor.config` does not pull in torch.
    if name in ("LLM", "Completion"):
        from conveyor.entrypoints import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from conveyor.sampling import SamplingParams

        return SamplingParams
    if name in ("Config", "load_config"):
        from conveyor import config

        return getattr(config, name)
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
