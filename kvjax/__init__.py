"""kvjax: long-context LLM inference in JAX with a compressed KV cache.

Public API: :func:`load_model` (Hugging Face folders and hub ids, GGUF files, and the embedded default
``"smollm2-135m-instruct"``), :func:`generate`, :mod:`kvjax.methods` (``kvjax.methods.get("snapkv",
budget=0.2)``), :mod:`kvjax.engine` (prefill / decode_step / run_loop for your own loops), :mod:`kvjax.budget`,
:class:`Model`, :class:`ModelConfig`, the pure model functions in :mod:`kvjax.model`, and :mod:`kvjax.sharding`
(:func:`shard` a model over a ``("data", "model")`` mesh, or ``load_model(..., mesh=...)``), :mod:`kvjax.prefilled`
(one prefill, many methods) and :mod:`kvjax.questions` (one compressed context, many questions).
"""

from kvjax import budget, engine, methods, model, prefilled, questions, sharding
from kvjax.config import ModelConfig, RopeConfig
from kvjax.engine import generate
from kvjax.loading import Model, load_model
from kvjax.sharding import shard

__all__ = [
    "Model",
    "ModelConfig",
    "RopeConfig",
    "budget",
    "engine",
    "generate",
    "load_model",
    "methods",
    "model",
    "prefilled",
    "questions",
    "shard",
    "sharding",
]
__version__ = "0.2.0"
