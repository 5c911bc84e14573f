"""Model configuration for the Llama family, parsed from a Hugging Face ``config.json``.

Supported architectures (``model_type``): ``llama`` (Llama 2, Llama 3/3.1/3.2, SmolLM2), ``mistral``
(v0.1 with its sliding window honoured, v0.2/v0.3 without one) and ``qwen2`` (Qwen2/Qwen2.5: q/k/v biases,
optional per-layer sliding window). Both transformers 4.x and 5.x key spellings are accepted
(``rope_scaling`` / ``rope_parameters``, ``torch_dtype`` / ``dtype``). Anything kvjax does not implement
raises a ``ValueError`` naming the option, never a silently different model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF ``rotate_half`` layout).

    ``rope_type``: ``"default"``, ``"linear"`` (positions divided by ``factor``) or ``"llama3"`` (Llama 3.1
    frequency-dependent scaling with ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings``).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    # Per layer: None (full causal attention) or the sliding-window size in tokens (Mistral v0.1, Qwen2).
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None

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
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
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


def _rope_from_hf(cfg: Mapping[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported by kvjax (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}); use a checkpoint without it or add it to kvjax/rope.py"
        )
    rope = RopeConfig(theta=float(theta), rope_type=rope_type, factor=float(params.get("factor", 1.0)))
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
    return rope


def _sliding_windows(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if model_type == "llama" or window is None:
        return (None,) * num_layers
    if model_type == "qwen2":
        if not cfg.get("use_sliding_window", False):
            return (None,) * num_layers
        layer_types = cfg.get("layer_types")
        if layer_types is None:  # transformers 4.x: layers >= max_window_layers use the window
            first = int(cfg.get("max_window_layers", num_layers))
            layer_types = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return (int(window),) * num_layers  # mistral


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = cfg.get("architectures")
        raise ValueError(
            f"model_type={model_type!r} (architectures={archs}) is not supported; kvjax implements "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama 2/3/3.1/3.2, SmolLM2, Mistral, Qwen2/2.5)"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; the Llama family uses 'silu'")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    num_layers = int(cfg["num_hidden_layers"])
    attention_bias = bool(cfg.get("attention_bias", False)) or model_type == "qwen2"
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        o_bias=model_type == "llama" and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_windows=_sliding_windows(cfg, model_type, num_layers),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
    )
