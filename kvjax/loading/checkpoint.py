"""Hugging Face checkpoints (safetensors, single file or sharded) -> kvjax params pytree.

A checkpoint is a folder with ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` plus the shards it names. Every tensor kvjax expects must be found and none
may be left over (except known non-parameters such as rotary ``inv_freq`` buffers, and an ``lm_head``
duplicate of tied embeddings); anything else is an error naming the tensors. Tensors are read in the
checkpoint's dtype (bf16/fp16/fp32) and cast to the requested dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig
from kvjax.model import Params

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


#: Tensors of a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration) outside its text tower: left out.
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")
#: Where the text tower's ``model.*`` tensors live in a Gemma3ForConditionalGeneration checkpoint (transformers 5.x,
#: 4.x), and its LM head.
_TOWER_PREFIXES = (
    ("model.language_model.", "lm_head.weight"),
    ("language_model.model.", "language_model.lm_head.weight"),
)


def expected_tensors(
    cfg: ModelConfig, prefix: str = "model.", head: str = "lm_head.weight"
) -> dict[tuple, tuple[str, bool]]:
    """Map params path -> (HF tensor name, transpose?) for every tensor ``cfg`` needs (``prefix``: where the
    decoder's tensors live, ``head``: the LM head's name)."""
    out: dict[tuple, tuple[str, bool]] = {
        ("embed",): (prefix + "embed_tokens.weight", False),
        ("final_norm",): (prefix + "norm.weight", False),
    }
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = (head, True)
    for i in range(cfg.num_layers):
        p = f"{prefix}layers.{i}."
        layer = {
            "attn_norm": (p + "input_layernorm.weight", False),
            "mlp_norm": (p + "post_attention_layernorm.weight", False),
            "wq": (p + "self_attn.q_proj.weight", True),
            "wk": (p + "self_attn.k_proj.weight", True),
            "wv": (p + "self_attn.v_proj.weight", True),
            "wo": (p + "self_attn.o_proj.weight", True),
        }
        if cfg.num_experts:
            layer.update(
                router=(p + "mlp.router.weight", True),
                b_router=(p + "mlp.router.bias", False),
                experts_gate_up=(p + "mlp.experts.gate_up_proj", False),
                experts_b_gate_up=(p + "mlp.experts.gate_up_proj_bias", False),
                experts_down=(p + "mlp.experts.down_proj", False),
                experts_b_down=(p + "mlp.experts.down_proj_bias", False),
            )
        else:
            layer.update(
                w_gate=(p + "mlp.gate_proj.weight", True),
                w_up=(p + "mlp.up_proj.weight", True),
                w_down=(p + "mlp.down_proj.weight", True),
            )
        if cfg.post_norms:  # Gemma 3: four norms a layer
            layer.update(
                post_attn_norm=(p + "post_attention_layernorm.weight", False),
                mlp_norm=(p + "pre_feedforward_layernorm.weight", False),
                post_mlp_norm=(p + "post_feedforward_layernorm.weight", False),
            )
        if cfg.qk_norm:
            layer.update(q_norm=(p + "self_attn.q_norm.weight", False), k_norm=(p + "self_attn.k_norm.weight", False))
        if cfg.attention_sinks:
            layer["sinks"] = (p + "self_attn.sinks", False)
        if cfg.attention_bias:
            for n in "qkv":
                layer[f"b{n}"] = (p + f"self_attn.{n}_proj.bias", False)
        if cfg.o_bias:
            layer["bo"] = (p + "self_attn.o_proj.bias", False)
        if cfg.mlp_bias:
            for n in ("gate", "up", "down"):
                layer[f"b_{n}"] = (p + f"mlp.{n}_proj.bias", False)
        for k, v in layer.items():
            out[("layers", i, k)] = v
    return out


def _shard_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> file holding it."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: folder / shard for name, shard in weight_map.items()}
        missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if missing:
            raise FileNotFoundError(
                f"checkpoint {folder} is missing shard file(s) {missing} named in {index.name}; "
                "download the complete checkpoint"
            )
        return files
    if single.is_file():
        return {name: single for name in _header(single)[1]}
    raise FileNotFoundError(
        f"no safetensors weights in {folder}: expected model.safetensors or model.safetensors.index.json "
        "(PyTorch .bin checkpoints are not supported; re-save with safe_serialization=True)"
    )


def load_safetensors_params(folder: str | Path, cfg: ModelConfig, dtype=jnp.float32) -> Params:
    """Read a HF folder's safetensors into the params pytree of ``kvjax.model`` in ``dtype``."""
    folder = Path(folder)
    files = _shard_files(folder)
    prefix, head = "model.", "lm_head.weight"
    if cfg.model_type == "gemma3":  # the text tower of Gemma3ForConditionalGeneration
        found = [(p, h) for p, h in _TOWER_PREFIXES if p + "embed_tokens.weight" in files]
        if not found:
            raise ValueError(
                f"checkpoint {folder} is a gemma3 (multimodal) config but holds no text tower "
                f"({' or '.join(p + 'embed_tokens.weight' for p, _ in _TOWER_PREFIXES)})"
            )
        prefix, head = found[0]
        files = {n: f for n, f in files.items() if not n.startswith(_VISION_PREFIXES)}
    expected = expected_tensors(cfg, prefix, head)
    wanted = {hf for hf, _ in expected.values()}
    missing = sorted(wanted - files.keys())
    if missing:
        raise ValueError(
            f"checkpoint {folder} lacks {len(missing)} tensor(s) the {cfg.model_type} config "
            f"needs, e.g. {missing[:5]}; the config and weights do not match"
        )
    extra = sorted(
        n
        for n in files.keys() - wanted
        if not n.endswith(_IGNORED_SUFFIXES) and not (n == head and cfg.tie_word_embeddings)
    )
    if extra:
        raise ValueError(
            f"checkpoint {folder} has {len(extra)} tensor(s) kvjax does not use, e.g. {extra[:5]}; "
            "the architecture has options kvjax does not implement"
        )
    # Group by file so each shard is opened once.
    by_file: dict[Path, list[tuple[tuple, str, bool]]] = {}
    for path, (hf, transpose) in expected.items():
        by_file.setdefault(files[hf], []).append((path, hf, transpose))
    flat: dict[tuple, jnp.ndarray] = {}
    for file, items in by_file.items():
        tensors = _mapped(file)
        for path, hf, transpose in items:
            t = tensors[hf].T if transpose else tensors[hf]
            # cast and laid out on the host in one copy (never a view of the mapped file) that goes to the device
            flat[path] = jnp.asarray(np.array(t, dtype=dtype, order="C"))
        del tensors
    return assemble(flat, cfg.num_layers)


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16, "I64": np.int64}
_DTYPES.update(I32=np.int32, I16=np.int16, I8=np.int8, U8=np.uint8, BOOL=np.bool_)


def _header(file: Path) -> tuple[int, dict]:
    """A safetensors file's data offset and its tensors' ``{name: {dtype, shape, data_offsets}}`` (the 8-byte
    little-endian header length, then the JSON header; its ``__metadata__`` left out)."""
    with open(file, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


def _mapped(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only numpy view of the file mapped into memory (the format: an
    8-byte little-endian header length, a JSON header of ``{name: {dtype, shape, data_offsets}}``, the data).
    Read this way, a weight's cast and transpose make one host copy that goes straight to the device, where the
    reader's framework arrays and a jax ``.T`` of each left ~180 MiB of freed buffers in the process (SmolLM2-135M,
    float32); bfloat16 comes through ``ml_dtypes`` (safetensors' numpy reader has no bfloat16)."""
    start, header = _header(file)
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=start)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has dtype {info['dtype']}, which kvjax does not read")
        begin, end = info["data_offsets"]
        out[name] = data[begin:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def assemble(flat: dict[tuple, jnp.ndarray], num_layers: int) -> Params:
    """Nest ``{("layers", i, name): array, ("embed",): array, ...}`` into the params pytree."""
    params: Params = {"layers": tuple({} for _ in range(num_layers))}
    for path, value in flat.items():
        if path[0] == "layers":
            params["layers"][path[1]][path[2]] = value
        else:
            params[path[0]] = value
    return params


def check_shapes(cfg: ModelConfig, params: Params) -> None:
    """Raise a ValueError when a tensor's shape disagrees with the config."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    want = {"embed": (cfg.vocab_size, h), "final_norm": (h,), "lm_head": (h, cfg.vocab_size)}
    lw = {
        "attn_norm": (h,),
        "mlp_norm": (h,),
        "wq": (h, cfg.num_heads * d),
        "wk": (h, cfg.num_kv_heads * d),
        "wv": (h, cfg.num_kv_heads * d),
        "wo": (cfg.num_heads * d, h),
        "w_gate": (h, f),
        "w_up": (h, f),
        "w_down": (f, h),
        "bq": (cfg.num_heads * d,),
        "bk": (cfg.num_kv_heads * d,),
        "bv": (cfg.num_kv_heads * d,),
        "bo": (h,),
        "b_gate": (f,),
        "b_up": (f,),
        "b_down": (h,),
        "q_norm": (d,),
        "k_norm": (d,),
        "post_attn_norm": (h,),
        "post_mlp_norm": (h,),
        "sinks": (cfg.num_heads,),
        "router": (h, cfg.num_experts),
        "b_router": (cfg.num_experts,),
        "experts_gate_up": (cfg.num_experts, h, 2 * f),
        "experts_b_gate_up": (cfg.num_experts, 2 * f),
        "experts_down": (cfg.num_experts, f, h),
        "experts_b_down": (cfg.num_experts, h),
    }
    problems = [
        f"{k}: {tuple(v.shape)} != {want[k]}" for k, v in params.items() if k != "layers" and tuple(v.shape) != want[k]
    ]
    for i, lp in enumerate(params["layers"]):
        problems += [f"layers.{i}.{k}: {tuple(v.shape)} != {lw[k]}" for k, v in lp.items() if tuple(v.shape) != lw[k]]
    if problems:
        raise ValueError(f"weights do not match the config: {problems[:5]}")
