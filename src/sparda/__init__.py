"""sparda: long-context LLM inference with SparDA (Sparse Decoupled Attention)."""

from sparda.config import METHODS, PRESETS, SelectionConfig, SpardaConfig
from sparda.engine.llm import LLM, Completion
from sparda.errors import SpardaError

__version__ = "0.1.0"

__all__ = ["LLM", "Completion", "SelectionConfig", "SpardaConfig", "SpardaError", "METHODS",
           "PRESETS", "__version__"]
