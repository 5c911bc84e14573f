"""GGUF files (llama.cpp) -> ``ModelConfig`` and kvjax params.

Used for the embedded default model (SmolLM2-135M-Instruct, Q4_1). Tensors are dequantized with the ``gguf``
package (to float32, then cast). llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` so that
RoPE pairs are interleaved (``convert_hf_to_gguf.py: LlamaModel.permute``); we undo it so keys are in HF's
``rotate_half`` layout again. ``general.architecture`` ``"llama"``, ``"qwen3"`` and ``"gemma3"`` are supported:

- ``qwen3``: converted without the permutation (NeoX-style RoPE, i.e. ``rotate_half`` already), plus
  ``attn_q_norm`` / ``attn_k_norm``;
- ``gemma3``: no permutation either; llama.cpp stores every Gemma norm as ``1 + w`` (undone here, as transformers'
  GGUF reader does), names the four norms ``attn_norm``, ``post_attention_norm``, ``ffn_norm`` (the pre-MLP one)
  and ``post_ffw_norm``, and fixes in code what the file does not say: five local layers to one global
  (``gemma3.attention.sliding_window`` the window), a local RoPE base of 10000, and scores scaled by
  ``1/sqrt(head_dim)`` (``1/sqrt(hidden / heads)`` for the 62-layer 27B model). Its tokenizer is SentencePiece
  (``tokenizer.ggml.model = "llama"``), which :class:`kvjax.loading.tokenizer.GGUFTokenizer` does not read: load such a
  file with ``tokenizer=False`` (token ids), or its Hugging Face folder.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kvjax.loading.checkpoint import assemble, check_shapes
from kvjax.config import ModelConfig, RopeConfig
from kvjax.model import Params

_LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "ffn_norm": "mlp_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
}
#: ``general.architecture`` -> (model_type, extra per-layer tensors, whether q/k rows are permuted)
_ARCHS = {
    "llama": ("llama", {}, True),
    "qwen3": ("qwen3", {"attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}, False),
    "gemma3": (
        "gemma3_text",
        {
            "attn_q_norm": "q_norm",
            "attn_k_norm": "k_norm",
            "post_attention_norm": "post_attn_norm",
            "post_ffw_norm": "post_mlp_norm",
        },
        False,
    ),
}
#: llama.cpp's Gemma 3 constants (``llama-model.cpp``): a global layer every 6, the local layers' RoPE base.
_GEMMA3_PATTERN, _GEMMA3_LOCAL_BASE, _GEMMA3_27B_LAYERS = 6, 10000.0, 62


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` for ``path`` (FileNotFoundError naming it when absent)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    return gguf.GGUFReader(str(path))


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(
            f"GGUF general.architecture={arch!r} is not supported; kvjax loads {sorted(_ARCHS)} GGUF files "
            "(use the Hugging Face safetensors checkpoint for other architectures)"
        )
    a = arch  # the metadata keys' prefix
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            "this GGUF stores per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 style), which "
            "kvjax's GGUF loader does not implement; load the Hugging Face checkpoint instead"
        )
    scaling = field(reader, f"{a}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(
            f"GGUF {a}.rope.scaling.type={scaling!r} is not supported (supported: none, linear); load the Hugging "
            "Face checkpoint, whose YaRN kvjax implements"
        )
    heads = int(field(reader, f"{a}.attention.head_count"))
    hidden = int(field(reader, f"{a}.embedding_length"))
    head_dim = int(field(reader, f"{a}.attention.key_length", hidden // heads))
    vocab = field(reader, f"{a}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    rope = RopeConfig(
        theta=float(field(reader, f"{a}.rope.freq_base", 10000.0)),
        rope_type={"none": "default"}.get(scaling, scaling),
        factor=float(field(reader, f"{a}.rope.scaling.factor", 1.0)),
    )
    return ModelConfig(
        model_type=_ARCHS[arch][0],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(field(reader, f"{a}.feed_forward_length")),
        num_layers=int(field(reader, f"{a}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{a}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope=rope,
        max_position_embeddings=int(field(reader, f"{a}.context_length", 4096)),
        qk_norm=arch in ("qwen3", "gemma3"),
        **(_gemma3(reader, hidden, heads, head_dim) if arch == "gemma3" else {}),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        checkpoint_dtype="gguf",
    )


def _gemma3(reader, hidden: int, heads: int, head_dim: int) -> dict:
    """The Gemma 3 fields of :class:`ModelConfig` from a ``gemma3`` GGUF and llama.cpp's constants (module doc)."""
    layers = int(field(reader, "gemma3.block_count"))
    window = field(reader, "gemma3.attention.sliding_window")
    windows = tuple(None if window is None or (i + 1) % _GEMMA3_PATTERN == 0 else int(window) for i in range(layers))
    return dict(
        sliding_windows=windows,
        norm_style="gemma",
        post_norms=True,
        embed_scale=True,
        query_pre_attn_scalar=float(hidden // heads if layers == _GEMMA3_27B_LAYERS else head_dim),
        hidden_act="gelu_tanh",
        rope_local=RopeConfig(theta=_GEMMA3_LOCAL_BASE),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: rows ``[out, in]`` back to HF's rotate_half order."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    """float32 array in PyTorch layout (``[out, in]`` for matrices)."""
    import gguf

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.asarray(data, dtype=np.float32).reshape(shape)


def load_gguf_params(reader, cfg: ModelConfig, dtype=jnp.float32) -> Params:
    """Dequantize every tensor into the params pytree of ``kvjax.model`` in ``dtype``."""
    flat: dict[tuple, jnp.ndarray] = {}
    unknown = []
    arch = field(reader, "general.architecture", "llama")
    _, extra, permuted = _ARCHS.get(arch, _ARCHS["llama"])
    names = {**_LAYER_NAMES, **extra}
    for t in reader.tensors:
        w = _dequantize(t)
        parts = t.name.split(".")
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norms with the 1 added
        if t.name == "token_embd.weight":
            flat[("embed",)] = w
        elif t.name == "output_norm.weight":
            flat[("final_norm",)] = w
        elif t.name == "output.weight":
            flat[("lm_head",)] = w.T
        elif parts[0] == "blk" and len(parts) == 4 and parts[2] in names and parts[3] == "weight":
            name = names[parts[2]]
            if name == "wq" and permuted:
                w = _unpermute(w, cfg.num_heads)
            elif name == "wk" and permuted:
                w = _unpermute(w, cfg.num_kv_heads)
            flat[("layers", int(parts[1]), name)] = w if w.ndim == 1 else w.T
        else:
            unknown.append(t.name)
    if unknown:
        raise ValueError(f"GGUF has tensors kvjax does not understand: {unknown[:5]}")
    params = assemble({k: jnp.asarray(v, dtype=dtype) for k, v in flat.items()}, cfg.num_layers)
    missing = [i for i, lp in enumerate(params["layers"]) if len(lp) != len(names)]
    if missing or "embed" not in params or "final_norm" not in params:
        raise ValueError(f"GGUF is incomplete: layers {missing[:5]} lack tensors, or embeddings/norm are missing")
    check_shapes(cfg, params)
    return params
