"""KV-cache methods behind one interface (see :mod:`kvjax.methods.base`), and their registry.

>>> kvjax.methods.get("snapkv", budget=0.2)     # 20% of each prompt
>>> kvjax.methods.get("h2o", budget=256)        # 256 tokens
>>> kvjax.methods.get("quest", budget=1024)     # attend <= 1024 tokens (pages of 16) per decode step
"""

from __future__ import annotations

import dataclasses

from kvjax.methods.base import Capacity, LayerContext, Method, SlotCache, SlotMethod
from kvjax.methods.chelsea import Chelsea
from kvjax.methods.chunkkv import ChunkKV
from kvjax.methods.clusterkv import ClusterKV
from kvjax.methods.full import Full
from kvjax.methods.h2o import H2O
from kvjax.methods.less import Less
from kvjax.methods.pqcache import PQCache
from kvjax.methods.quest import Quest
from kvjax.methods.snapkv import PyramidKV, SnapKV
from kvjax.methods.streaming import StreamingLLM

REGISTRY: dict[str, type] = {
    cls.name: cls
    for cls in (Full, StreamingLLM, H2O, SnapKV, PyramidKV, ChunkKV, Chelsea, PQCache, ClusterKV, Quest, Less)
}


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str, **options):
    """The method config registered as ``name`` with ``options`` (e.g. ``budget=0.2``, ``window=8``)."""
    if name not in REGISTRY:
        raise ValueError(f"method={name!r} is not registered; choose one of {', '.join(REGISTRY)}")
    cls = REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"method {name!r} has no option(s) {unknown}; its options are {sorted(fields) or 'none'}")
    return cls(**options)


def small(name: str, **options):
    """``get(name, ...)`` at test sizes: the method's own :meth:`~kvjax.methods.base.Method.small_options` (windows,
    chunks, pages and sinks shrunk so that it compresses prompts of tens of tokens), then ``options`` over them."""
    if name not in REGISTRY:
        get(name)  # the unknown-name error
    return get(name, **{**REGISTRY[name].small_options(), **options})


__all__ = [
    "Capacity",
    "Chelsea",
    "ChunkKV",
    "ClusterKV",
    "Full",
    "H2O",
    "LayerContext",
    "Less",
    "Method",
    "PQCache",
    "PyramidKV",
    "Quest",
    "REGISTRY",
    "SlotCache",
    "SlotMethod",
    "SnapKV",
    "StreamingLLM",
    "get",
    "names",
    "small",
]
