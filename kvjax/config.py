"""Model configuration, parsed from a Hugging Face ``config.json``.

Supported architectures (``model_type``; docs/architecture.md#model-families has the table):

- ``llama`` (Llama 2, Llama 3/3.1/3.2, SmolLM2), ``mistral`` (v0.1 with its sliding window, v0.2/v0.3 without
  one), ``qwen2`` (Qwen2/Qwen2.5: q/k/v biases, optional per-layer sliding window);
- ``qwen3``: RMSNorm of every query and key head before RoPE (``qk_norm``), no q/k/v bias;
- ``gemma3_text`` (Gemma3ForCausalLM) and ``gemma3`` (the text tower of Gemma3ForConditionalGeneration):
  ``layer_types`` local (sliding window) / global layers, a RoPE base and scaling per layer type (``rope_local``),
  QK-norm, ``(1 + w)`` RMSNorms before and after attention and MLP, the sqrt(hidden) embedding scale,
  ``query_pre_attn_scalar``, a GELU-tanh MLP and the final logit soft-cap;
- ``gpt_oss``: learned per-head attention sinks, alternating sliding-window and full layers, attention biases, a
  mixture-of-experts MLP (top-k routing, clamped SwiGLU).

RoPE scaling: ``default``, ``linear``, ``llama3`` and static ``yarn`` (any family). Both transformers 4.x and 5.x
key spellings are accepted (``rope_scaling`` / ``rope_parameters``, per layer type or not; ``torch_dtype`` /
``dtype``). Anything kvjax does not implement raises a ``ValueError`` naming the option, never a silently
different model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from kernels_pallas.checks import check_int

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3", "gpt_oss")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: model_type -> the families' names, for messages and docs.
FAMILIES = {
    "llama": "Llama 2/3/3.1/3.2, SmolLM2",
    "mistral": "Mistral",
    "qwen2": "Qwen2/2.5",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma 3 (text)",
    "gemma3": "Gemma 3 (text tower)",
    "gpt_oss": "gpt-oss",
}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF ``rotate_half`` layout).

    ``rope_type``: ``"default"``, ``"linear"`` (positions divided by ``factor``), ``"llama3"`` (Llama 3.1
    frequency-dependent scaling with ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings``) or ``"yarn"`` (static YaRN, Peng et al. 2023: frequencies blended
    between interpolated and extrapolated over the ramp ``beta_fast``..``beta_slow`` rotations of
    ``original_max_position_embeddings``, cos and sin scaled by ``attention_factor``).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    #: cos and sin are multiplied by it (YaRN's mscale; 1 for the other types)
    attention_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static (hashable) description of a Llama-family decoder. Units are elements, not bytes."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v (and o for llama) projections carry a bias
    o_bias: bool = False
    mlp_bias: bool = False
    # Per layer: None (full causal attention, a global layer) or the sliding-window size in tokens (a local layer:
    # Mistral v0.1, Qwen2/3 with use_sliding_window, Gemma 3's and gpt-oss's sliding_attention layers).
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None
    #: RMSNorm over each query and key head (weights ``[head_dim]``) before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    #: ``"llama"``: ``w * norm(x).astype(dtype)``; ``"gemma"``: ``((1 + w) * norm(x)).astype(dtype)`` in float32.
    norm_style: str = "llama"
    #: RMSNorms after attention and after the MLP too, before each residual add (Gemma 3's four norms a layer).
    post_norms: bool = False
    #: embeddings multiplied by sqrt(hidden_size) (cast to the weights' dtype), Gemma 3.
    embed_scale: bool = False
    #: scores are ``q·k * query_pre_attn_scalar**-0.5`` instead of ``/ sqrt(head_dim)`` (Gemma 3); None: head_dim.
    query_pre_attn_scalar: float | None = None
    #: the MLP's activation: ``"silu"`` or ``"gelu_tanh"`` (Gemma 3)
    hidden_act: str = "silu"
    #: logits ``c * tanh(logits / c)`` (Gemma 3's ``final_logit_softcapping``); None: none.
    final_logit_softcap: float | None = None
    #: RoPE of the local (sliding-window) layers where it differs from ``rope`` (Gemma 3's rope_local_base_freq);
    #: None: every layer uses ``rope``.
    rope_local: RopeConfig | None = None
    #: a learned logit per query head in every attention softmax (``sinks [Hq]`` per layer; gpt-oss).
    attention_sinks: bool = False
    #: mixture-of-experts MLP (gpt-oss): experts, experts per token, and the clamped SwiGLU's gain and limit.
    num_experts: int = 0
    experts_per_token: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            check_int(name, getattr(self, name), numpy_ok=True)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads="
                f"{self.num_kv_heads}; grouped-query attention needs whole groups"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers")
        if self.norm_style not in ("llama", "gemma"):
            raise ValueError(f"norm_style={self.norm_style!r} must be 'llama' or 'gemma'")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act={self.hidden_act!r} must be 'silu' or 'gelu_tanh'")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token={self.experts_per_token} must be in [1, num_experts={self.num_experts}]"
            )

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE of layer ``layer`` (a static int): ``rope_local`` on a local layer where set, else ``rope``."""
        if self.rope_local is not None and self.sliding_windows[layer] is not None:
            return self.rope_local
        return self.rope

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer is local (keeps a sliding window): its cache is a ring buffer of the window
        (:mod:`kvjax.methods.plans.hybrid`)."""
        return any(w is not None for w in self.sliding_windows)

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The global (full-attention) layers: every layer, or a hybrid model's layers without a sliding window
        (Gemma 3: every sixth). The ones a compression method compresses; the local ones keep their window."""
        return tuple(layer for layer, window in enumerate(self.sliding_windows) if window is None)

    @property
    def layers_differ(self) -> bool:
        """Whether layers differ in window or RoPE (a scanned layer loop needs them all alike)."""
        return len(set(self.sliding_windows)) > 1

    @property
    def q_scale(self) -> float:
        """The factor q is multiplied by after RoPE so that the attention's ``1/sqrt(head_dim)`` gives the model's
        score scale: ``sqrt(head_dim / query_pre_attn_scalar)`` (1 without one)."""
        if self.query_pre_attn_scalar is None:
            return 1.0
        return (self.head_dim / self.query_pre_attn_scalar) ** 0.5

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1: MHA, num_heads: MQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Parse a Hugging Face ``config.json`` dict (transformers 4.x or 5.x spelling)."""
        return _from_hf(cfg)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"config file {path} does not exist; a Hugging Face model folder must contain config.json"
            )
        return _from_hf(json.loads(path.read_text()))


def _rope_params(cfg: Mapping[str, Any], layer_type: str | None = None) -> dict:
    """The RoPE parameters of one layer type (``"full_attention"``, ``"sliding_attention"``; None: the model's one
    dict) from transformers 5.x ``rope_parameters`` (flat or nested by layer type) or 4.x ``rope_theta`` +
    ``rope_scaling`` (+ Gemma 3's ``rope_local_base_freq``, whose scaling applies to its global layers only)."""
    params = cfg.get("rope_parameters")
    nested = bool(params) and any(k in params for k in ("full_attention", "sliding_attention"))
    if nested:
        return dict(params.get(layer_type or "full_attention") or {})
    if layer_type == "sliding_attention":  # Gemma 3, 4.x spelling: local layers are unscaled
        return {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    return dict(params or cfg.get("rope_scaling") or {})


def _rope_from_hf(cfg: Mapping[str, Any], layer_type: str | None = None, default_theta: float = 10000.0) -> RopeConfig:
    params = _rope_params(cfg, layer_type)
    theta = params.get("rope_theta", cfg.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported by kvjax (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}); use a checkpoint without it or add it to kvjax/model/rope.py"
        )
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"partial_rotary_factor={partial} is not supported (kvjax rotates the whole head); use a model "
            "with partial_rotary_factor=1.0"
        )
    rope = RopeConfig(theta=float(theta), rope_type=rope_type, factor=float(params.get("factor") or 1.0))
    if rope_type == "llama3":
        missing = [
            k
            for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            if k not in params
        ]
        if missing:
            raise ValueError(f"rope_scaling of type 'llama3' lacks {missing}; the config is incomplete")
        rope = dataclasses.replace(
            rope,
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    if rope_type == "yarn":
        rope = _yarn(cfg, params, rope)
    return rope


def _yarn(cfg: Mapping[str, Any], params: Mapping[str, Any], rope: RopeConfig) -> RopeConfig:
    """Static YaRN as ``transformers.modeling_rope_utils._compute_yarn_parameters`` reads it."""
    import math

    original = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    original = int(original or cfg.get("max_position_embeddings", 4096))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else cfg.get("max_position_embeddings", original) / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    top = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    truncate = top.get("truncate", params.get("truncate", True))
    return dataclasses.replace(
        rope,
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(truncate),
        attention_factor=float(attention),
    )


def _layer_types(cfg: Mapping[str, Any], num_layers: int, every: int) -> list[str]:
    """``layer_types`` from the config, else every ``every``-th layer full and the others sliding (Gemma 3's
    ``sliding_window_pattern``, gpt-oss's alternation)."""
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("sliding_window_pattern", every))
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={num_layers}")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(
            f"layer_types {unknown} are not supported (kvjax implements 'sliding_attention' and 'full_attention')"
        )
    return list(types)


def _sliding_windows(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if model_type == "llama" or window is None:
        return (None,) * num_layers
    if model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            return (None,) * num_layers
        layer_types = cfg.get("layer_types")
        if layer_types is None:  # transformers 4.x: layers >= max_window_layers use the window
            first = int(cfg.get("max_window_layers", num_layers))
            layer_types = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if model_type in ("gemma3_text", "gpt_oss"):
        types = _layer_types(cfg, num_layers, 6 if model_type == "gemma3_text" else 2)
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return (int(window),) * num_layers  # mistral


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _refuse(cfg: Mapping[str, Any], model_type: str) -> None:
    """ValueError for options of a supported family that kvjax does not implement."""
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", quant) if isinstance(quant, Mapping) else quant
        raise ValueError(
            f"quantization_config (quant_method={method!r}) is not supported: kvjax reads bf16/fp16/fp32 "
            "safetensors; use a dequantized checkpoint (for gpt-oss, a BF16 copy of the MXFP4 release)"
        )
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"attn_logit_softcapping={cfg['attn_logit_softcapping']} is not supported (the decode kernels take the "
            "plain softmax; Gemma 3 checkpoints set it to null); use a model without attention soft-capping"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(
            "use_bidirectional_attention=True (an encoder-style Gemma 3) is not supported; kvjax decodes causal "
            "language models"
        )
    if model_type == "gpt_oss" and cfg.get("num_experts_per_tok", 1) > cfg.get("num_local_experts", 1):
        raise ValueError("num_experts_per_tok exceeds num_local_experts; the config is inconsistent")


_DEFAULT_TIED = {"gemma3_text": True}
_DEFAULT_EPS = {"gpt_oss": 1e-5}


def _from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type == "gemma3":  # Gemma3ForConditionalGeneration: its text tower
        text = dict(cfg.get("text_config") or {})
        text.setdefault("model_type", "gemma3_text")
        if text["model_type"] != "gemma3_text":
            raise ValueError(f"gemma3 text_config has model_type={text['model_type']!r}; expected 'gemma3_text'")
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
        for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
            if key in cfg and key not in text:
                text[key] = cfg[key]
        return dataclasses.replace(_from_hf(text), model_type="gemma3")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = cfg.get("architectures")
        raise ValueError(
            f"model_type={model_type!r} (architectures={archs}) is not supported; kvjax implements "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} ({'; '.join(dict.fromkeys(FAMILIES.values()))})"
        )
    _refuse(cfg, model_type)
    gemma = model_type == "gemma3_text"
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    if act not in acts or (acts[act] == "gelu_tanh") != gemma:
        want = "'gelu_pytorch_tanh'" if gemma else "'silu'"
        raise ValueError(f"hidden_act={act!r} is not supported for model_type={model_type!r}; it uses {want}")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    num_layers = int(cfg["num_hidden_layers"])
    bias = bool(cfg.get("attention_bias", model_type == "gpt_oss"))
    attention_bias = bias or model_type == "qwen2"
    windows = _sliding_windows(cfg, model_type, num_layers)
    default_theta = {"gemma3_text": 1e6, "gpt_oss": 150000.0}.get(model_type, 10000.0)
    rope = _rope_from_hf(cfg, "full_attention", default_theta)
    rope_local = None
    if gemma:
        rope_local = _rope_from_hf(cfg, "sliding_attention", 10000.0)
        rope_local = None if rope_local == rope else rope_local
    softcap = cfg.get("final_logit_softcapping") if gemma else None
    moe = model_type == "gpt_oss"
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", _DEFAULT_EPS.get(model_type, 1e-6))),
        rope=rope,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", _DEFAULT_TIED.get(model_type, False))),
        attention_bias=attention_bias,
        o_bias=model_type in ("llama", "qwen3", "gemma3_text", "gpt_oss") and bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_windows=windows,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        norm_style="gemma" if gemma else "llama",
        post_norms=gemma,
        embed_scale=gemma,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)) if gemma else None,
        hidden_act=acts[act],
        final_logit_softcap=float(softcap) if softcap is not None else None,
        rope_local=rope_local,
        attention_sinks=model_type == "gpt_oss",
        num_experts=int(cfg.get("num_local_experts", 0)) if moe else 0,
        experts_per_token=int(cfg.get("num_experts_per_tok", 0)) if moe else 0,
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )
