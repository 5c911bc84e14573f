"""GGUF files (llama.cpp) -> ``ModelConfig`` and kvjax params.

Used for the embedded default model (SmolLM2-135M-Instruct, Q4_1). Tensors are dequantized with the ``gguf``
package (to float32, then cast). llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` so that
RoPE pairs are interleaved (``convert_hf_to_gguf.py: LlamaModel.permute``); we undo it so keys are in HF's
``rotate_half`` layout again. ``general.architecture`` ``"llama"`` and ``"qwen3"`` are supported (Qwen3 is converted
without the permutation, its RoPE being NeoX-style, i.e. ``rotate_half`` already, and adds ``attn_q_norm`` /
``attn_k_norm``). Gemma 3 GGUF files are refused: their tokenizer is SentencePiece (``tokenizer.ggml.model`` =
``llama``, which :class:`kvjax.tokenizer.GGUFTokenizer` does not read) and llama.cpp stores its norms as ``1 + w``
and fixes its local RoPE base and window pattern in code rather than in the file; load its safetensors.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kvjax.checkpoint import assemble, check_shapes
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
}


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
        qk_norm=arch == "qwen3",
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        checkpoint_dtype="gguf",
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
