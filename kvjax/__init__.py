"""kvjax: long-context LLM inference in JAX with a compressed KV cache.

Public API: :func:`load_model` (Hugging Face folders and hub ids, GGUF files, and the embedded default
``"smollm2-135m-instruct"``), :func:`generate`, :mod:`kvjax.methods` (``kvjax.methods.get("snapkv",
budget=0.2)``), :mod:`kvjax.engine` (prefill / decode_step / run_loop for your own loops), :mod:`kvjax.budget`,
:class:`Model`, :class:`ModelConfig`, the pure model functions in :mod:`kvjax.model`, and :mod:`kvjax.sharding`
(:func:`shard` a model over a ``("data", "model")`` mesh, or ``load_model(..., mesh=...)``),
:mod:`kvjax.engine.prefilled` (one prefill, many methods; also ``kvjax.engine.prefilled``) and
:mod:`kvjax.engine.questions` (one compressed context, many questions; also ``kvjax.engine.questions``).

The package, floor by floor (each imports only the floors below it): ``budget``, ``config`` and ``sharding``
(the shared vocabulary); :mod:`kvjax.model` (the decoder and its attention math); :mod:`kvjax.loading`
(checkpoints, GGUF, tokenizers, assets); :mod:`kvjax.methods` (the cache methods: they use the attention math,
never the decoder or the engine); :mod:`kvjax.engine` (the layer core and the drivers); ``cli``, ``analysis`` and
``calibrate_chelsea`` (tools over the rest). ``tests/test_architecture.py`` keeps the floors.
"""

from kvjax import budget, engine, methods, model, sharding
from kvjax.config import ModelConfig, RopeConfig
from kvjax.engine import generate, prefilled, questions
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
