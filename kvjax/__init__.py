"""kvjax: long-context LLM inference in JAX with a compressed KV cache.

Public API: :func:`load_model` (Hugging Face folders and hub ids, GGUF files, and the embedded default
``"smollm2-135m-instruct"``), :class:`Model`, :class:`ModelConfig`, and the pure model functions in
:mod:`kvjax.model`.
"""

from kvjax.config import ModelConfig, RopeConfig
from kvjax.loading import Model, load_model

__all__ = ["Model", "ModelConfig", "RopeConfig", "load_model"]
__version__ = "0.1.0"
