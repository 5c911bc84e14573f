"""Tiny random Hugging Face checkpoints for tests that need a real tokenizer (tasks that read text)."""

from pathlib import Path


def save_tiny(path, arch: str = "LlamaForCausalLM", **config) -> Path:
    """:func:`save_tiny_llama` for any transformers causal-LM class ``arch`` (``Qwen3ForCausalLM``,
    ``Gemma3ForCausalLM``, ``GptOssForCausalLM``, ...) with the same tokenizer and sizes."""
    return save_tiny_llama(path, arch=arch, **config)


def save_tiny_llama(path, arch: str = "LlamaForCausalLM", **config) -> Path:
    """A random Llama (``config`` overrides: sizes, heads, layers) with the embedded SmolLM2 tokenizer and chat
    template, written to ``path`` with ``save_pretrained``; weights x3 so next-token logits are peaked and depend
    on the input (away from a uniform distribution)."""
    import torch
    import transformers

    from kvjax import assets
    from kvjax.tokenizer import GGUFTokenizer

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
    torch.manual_seed(0)
    sizes = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    cls = getattr(transformers, arch)
    hf = cls(cls.config_class(vocab_size=len(tok), **{**sizes, **config})).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    hf.save_pretrained(path)
    return Path(path)
