"""The engine: the step (EngineCore), its async loop (AsyncEngine), the model runner and the sampler."""

from conveyor.engine.core import EngineCore
from conveyor.engine.loop import AsyncEngine

__all__ = ["AsyncEngine", "EngineCore"]
