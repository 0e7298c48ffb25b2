"""Generation apart from models and I/O: batching, sampling and the prefill/decode loop."""

from .prefill import PromptEmbedding
from .generate import Generation, StepModel, generate
from .sampling import SamplingParams

__all__ = ["Generation", "PromptEmbedding", "SamplingParams", "StepModel", "generate"]
