"""Generation apart from models and I/O: sequences, scheduler, KV cache, model runner, sampling."""

from .engine import Engine, EngineConfig
from .sampling import SamplingParams
from .sequence import Sequence

__all__ = ["Engine", "EngineConfig", "SamplingParams", "Sequence"]
