"""Chelsea's outlier heads (Hu et al., 2025, §5.4 and App. B; method note ``docs/notes/chelsea.md`` A12, spec §2.8):
the ``(layer, kv_head)`` pairs that keep their full cache instead of being merged, read from a calibration JSON
written by ``kvjax calibrate-chelsea`` or given as a tuple, and the static split of a layer's KV heads into the
compressed ones and the outlier ones.

Shapes: a layer's KV heads are split by static index tuples ``comp`` (compressed, ``Hc`` of them) and ``out``
(outlier, ``O``); :func:`select_heads` takes them from any ``[B, Hkv, ...]`` array; an outlier head's buffer is
``[B, O, n + Gamma, D]`` (:mod:`kvjax.methods.chelsea.attend` attends it).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np


def load_outlier_file(path: str) -> dict:
    """Read a calibration JSON written by ``kvjax calibrate-chelsea``. The file is read on every call (it is
    small) and its parse cached by content, so a file edited or rewritten in place is used as it is now, even
    within the same second and at the same size (an mtime/size key could miss that)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"outlier_heads={path!r}: no such file; run `kvjax calibrate-chelsea --model ... "
            "--out PATH` first, or pass a tuple of (layer, kv_head) pairs"
        )
    return _parse_outlier_file(p.read_text(), path)


@functools.lru_cache(maxsize=32)
def _parse_outlier_file(text: str, path: str) -> dict:
    data = json.loads(text)
    if "outlier_heads" not in data:
        raise ValueError(f"outlier_heads={path!r} has no 'outlier_heads' entry; it is not a calibration file")
    return data


def outlier_pairs(outlier_heads: str | tuple, model_cfg) -> frozenset:
    """The ``(layer, kv_head)`` pairs that keep their full cache (§5.4): ``outlier_heads`` is a calibration JSON
    path (:func:`load_outlier_file`, its model sizes checked against ``model_cfg``) or a tuple of pairs; every
    pair is checked to lie inside the model."""
    if isinstance(outlier_heads, str):
        data = load_outlier_file(outlier_heads)
        for key, want in (("num_layers", model_cfg.num_layers), ("num_kv_heads", model_cfg.num_kv_heads)):
            if key in data and data[key] != want:
                raise ValueError(
                    f"outlier_heads={outlier_heads!r} was calibrated for {key}={data[key]} "
                    f"but the model has {want}; recalibrate for this model"
                )
        pairs = data["outlier_heads"]
    else:
        pairs = outlier_heads
    out = set()
    for pair in pairs:
        layer, head = (int(x) for x in pair)
        if not (0 <= layer < model_cfg.num_layers and 0 <= head < model_cfg.num_kv_heads):
            raise ValueError(
                f"outlier head {tuple(pair)} is outside the model ({model_cfg.num_layers} layers, "
                f"{model_cfg.num_kv_heads} KV heads)"
            )
        out.add((layer, head))
    return frozenset(out)


def in_layer(pairs: frozenset, layer: int) -> int:
    """How many of the outlier ``pairs`` are heads of ``layer``."""
    return sum(1 for (l, _) in pairs if l == layer)


def layer_heads(pairs: frozenset, layer: int, num_kv_heads: int) -> tuple[list[int], list[int]]:
    """``(comp, out)``: the KV heads of ``layer`` that are compressed and those that are outlier heads, ascending."""
    out = sorted(h for (l, h) in pairs if l == layer)
    comp = [h for h in range(num_kv_heads) if h not in out]
    return comp, out


def select_heads(x, heads: tuple) -> jnp.ndarray:
    """Select KV heads (axis 1) of ``x [B, Hkv, ...]`` by a static index tuple; identity when it is all of them in
    order."""
    if tuple(heads) == tuple(range(x.shape[1])):
        return x
    return x[:, np.asarray(heads, np.int32)]


def head_sinks(kv_heads, g: int):
    """The layer's attention sinks (:mod:`kvjax.model.sinks`) of the query heads of ``kv_heads`` (each KV head's ``g``
    query heads, in order), or None on a model without sinks."""
    from kvjax.model import sinks

    s = sinks.current()
    if s is None:
        return None
    return s[np.asarray([h * g + j for h in kv_heads for j in range(g)], np.int32)]
