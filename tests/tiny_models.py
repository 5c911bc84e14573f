"""Tiny random models for the tests: in memory (:func:`tiny_config`, :func:`tiny_model`, behind the ``tiny`` fixture
of tests/conftest.py) and as Hugging Face checkpoints with a real tokenizer (:func:`save_tiny_llama`, for tasks that
read text)."""

from pathlib import Path

#: the tiny Llama's sizes; :func:`tiny_config`'s keyword arguments override them
TINY_SIZES = dict(
    model_type="llama",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)


def tiny_config(**sizes):
    """A ``kvjax.ModelConfig``: :data:`TINY_SIZES` (a 2-layer GQA 4/2 Llama, vocabulary 64, head_dim 16, 1024
    positions) with ``sizes`` (any ``ModelConfig`` field) overriding them."""
    from kvjax.config import ModelConfig

    return ModelConfig(**{**TINY_SIZES, **sizes})


def tiny_model(*, seed: int = 1, scale: float = 0.3, dtype="float32", name: str = "tiny", **sizes):
    """A ``kvjax.Model`` of :func:`tiny_config` ``(**sizes)`` with random weights (``random_params`` with
    ``PRNGKey(seed)``, std ``scale``, ``dtype``) and no tokenizer. The same arguments give the same weights, so a
    test's reference values stay fixed by what it passes here."""
    import jax
    import jax.numpy as jnp

    from kvjax.loading import Model
    from kvjax.model import random_params

    cfg = tiny_config(**sizes)
    return Model(cfg, random_params(cfg, jax.random.PRNGKey(seed), jnp.dtype(dtype), scale), None, name)


def save_tiny(path, arch: str = "LlamaForCausalLM", **config) -> Path:
    """:func:`save_tiny_llama` for any transformers causal-LM class ``arch`` (``Qwen3ForCausalLM``,
    ``Gemma3ForCausalLM``, ``GptOssForCausalLM``, ...) with the same tokenizer and sizes."""
    return save_tiny_llama(path, arch=arch, **config)


def save_tiny_llama(path, arch: str = "LlamaForCausalLM", **config) -> Path:
    """A random Llama (``config`` overrides: sizes, heads, layers) with the embedded SmolLM2 tokenizer and chat
    template, written to ``path`` with ``save_pretrained``; the weights are :func:`random_hf`'s."""
    import transformers

    from kvjax.loading import assets
    from kvjax.loading.tokenizer import GGUFTokenizer

    ours = GGUFTokenizer.from_gguf(assets.smollm2_gguf_path())
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=ours.backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tok.chat_template = ours.chat_template
    tok.save_pretrained(path)
    sizes = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    random_hf(arch, vocab_size=len(tok), **{**sizes, **config}).save_pretrained(path)
    return Path(path)


def random_hf(arch: str = "LlamaForCausalLM", **config):
    """A random ``transformers`` causal LM of class ``arch`` whose config has the fields ``config``, built after
    ``torch.manual_seed(0)`` (the same arguments give the same weights) with every weight matrix x3, so that
    next-token logits are peaked and depend on the input (away from a uniform distribution)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cls = getattr(transformers, arch)
    hf = cls(cls.config_class(**config)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    return hf
