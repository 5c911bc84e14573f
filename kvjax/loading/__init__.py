"""Loading a model: :func:`load_model` and what it reads.

- :mod:`kvjax.loading.load`: :class:`Model` and :func:`load_model` (the embedded models, a Hugging Face folder, a
  hub id, a ``.gguf`` file), re-exported here;
- :mod:`kvjax.loading.checkpoint`: safetensors (one file or sharded) -> params pytree;
- :mod:`kvjax.loading.gguf_loader`: GGUF -> :class:`~kvjax.config.ModelConfig` + params (dequantised);
- :mod:`kvjax.loading.tokenizer`: ``HFTokenizer``, ``GGUFTokenizer`` (BPE and SentencePiece), chat templates;
- :mod:`kvjax.loading.assets`: where the embedded assets are (pip packages; Gemma 3 270M joined into the cache).

``config.json`` is parsed by :class:`kvjax.config.ModelConfig` (beside this package: every package uses it).
"""

from kvjax.loading.load import Model, default_dtype, info, load_model

__all__ = ["Model", "default_dtype", "info", "load_model"]
