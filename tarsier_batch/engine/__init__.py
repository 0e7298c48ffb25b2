"""Generation apart from models and I/O: sequences, scheduler, KV cache, model runner, sampling."""

from .engine import Engine, EngineConfig
from .pruning import PruneConfig
from .sampling import SamplingParams
from .sequence import Sequence

__all__ = ["Engine", "EngineConfig", "PruneConfig", "SamplingParams", "Sequence"]
