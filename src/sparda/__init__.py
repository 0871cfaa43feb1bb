"""sparda: long-context LLM inference with SparDA (Sparse Decoupled Attention)."""

from sparda.config import METHODS, PRESETS, SelectionConfig, SpardaConfig
from sparda.engine.llm import LLM, Completion
from sparda.engine.sampling_params import SamplingParams
from sparda.engine.sequence import Delta, RequestOutput
from sparda.errors import SpardaError

__version__ = "0.1.0"

__all__ = ["LLM", "Completion", "SamplingParams", "RequestOutput", "Delta", "SelectionConfig", "SpardaConfig",
           "SpardaError", "METHODS", "PRESETS", "__version__"]
