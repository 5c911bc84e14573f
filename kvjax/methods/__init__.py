"""KV-cache methods behind one interface (see :mod:`kvjax.methods.base`), and their registry.

>>> kvjax.methods.get("snapkv", budget=0.2)     # 20% of each prompt
>>> kvjax.methods.get("h2o", budget=256)        # 256 tokens
>>> kvjax.methods.get("quest", budget=1024)     # attend <= 1024 tokens (pages of 16) per decode step
>>> kvjax.methods.get("snapkv", budget=0.2, decode_budget=1024, every=128)  # <= 1024 + 128 tokens while decoding

A method of your own joins the registry with :func:`register` (a class decorator); :func:`load_plugin` imports a
module or ``.py`` file that registers some, as the command-line tools' ``--plugin`` does (docs/interface.md,
"Writing your own method"; ``docs/examples/knorm.py`` is one).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path

from kvjax.methods.base import Capacity, LayerContext, Method, SlotCache, SlotMethod, check_registrable
from kvjax.methods.chelsea import Chelsea
from kvjax.methods.core.bounded import DEFAULT_EVERY, DecodeBudget
from kvjax.methods.chunkkv import ChunkKV
from kvjax.methods.clusterkv import ClusterKV
from kvjax.methods.full import Full
from kvjax.methods.h2o import H2O
from kvjax.methods.plans.hybrid import Hybrid, Window, for_model
from kvjax.methods.plans.layers import FullFirst, PerLayerPlan, method_of
from kvjax.methods.less import Less
from kvjax.methods.pqcache import PQCache
from kvjax.methods.quest import Quest
from kvjax.methods.core.scoring import ScoringMethod
from kvjax.methods.snapkv import PyramidKV, SnapKV
from kvjax.methods.streaming import StreamingLLM

REGISTRY: dict[str, type] = {
    cls.name: cls
    for cls in (Full, StreamingLLM, H2O, SnapKV, PyramidKV, ChunkKV, Chelsea, PQCache, ClusterKV, Quest, Less)
}


def names() -> list[str]:
    """The registered method names, in registry order (the built-in ones, then those :func:`register` added)."""
    return list(REGISTRY)


def cover(*traits: str, any_true: bool = False) -> tuple[str, ...]:
    """The first registered method (in registry order) of each combination of ``traits`` that occurs: the smallest
    set in which every declared behaviour named appears. A trait is an attribute of each method at its defaults (a
    capability of :class:`~kvjax.methods.base.Method` such as ``"recalls"`` or ``"attends_prompt"``, a field default
    such as ``"n_full"``, ClusterKV's and Quest's full first layers, or ``"budget"``, None for ``full``), taken as
    true or false. ``any_true``: only the combinations in which some trait holds. Tests choose their default-run
    methods with it, so that a method added to the registry is picked where it brings a behaviour no other has.

    >>> cover("recalls", "recompresses")
    ('full', 'chelsea', 'pqcache')"""
    defaults = {name: get(name) for name in REGISTRY}  # LESS's attends_prompt is its policy's: ask the instance
    unknown = [t for t in traits if not any(hasattr(m, t) for m in defaults.values())]
    if unknown:
        raise ValueError(f"trait(s) {unknown} are declared by no registered method (see kvjax.methods.base)")
    seen, out = set(), []
    for name, method in defaults.items():
        key = tuple(bool(getattr(method, t, None)) for t in traits)
        if key not in seen and (any(key) or not any_true):
            seen.add(key)
            out.append(name)
    return tuple(out)


def get(
    name: str,
    full_layers: int = 0,
    decode_budget: int | None = None,
    every: int | None = None,
    threshold: float | None = None,
    **options,
):
    """The method config registered as ``name`` with ``options`` (e.g. ``budget=0.2``, ``window=8``). ``full_layers=N``
    (any method): the first ``N`` layers keep the full cache, as the per-layer plan
    :class:`~kvjax.methods.plans.layers.FullFirst` ``(N, method)`` (not a method: :func:`method_of` names it).
    ``decode_budget=D`` (a method that scores its tokens: snapkv, pyramidkv, chunkkv): at most ``D`` tokens per
    layer and KV head plus ``every`` (default 128) while decoding, re-compressed every ``every`` steps, as
    :class:`~kvjax.methods.core.bounded.DecodeBudget` ``(method, D, every)``; with ``threshold=tau`` each re-compression
    keeps the tokens whose score passes ``tau``, at most ``D``. ``D`` is per layer for snapkv and chunkkv; pyramidkv
    splits it over the layers by its pyramid (their mean is ``D``; layer ``l`` keeps ``method.target(l,
    num_layers)``: at ``D=4096`` on 30 layers, 7980 at layer 0 down to 237 at the top), so its top layers
    re-compress long before a sequence reaches ``D`` tokens."""
    if full_layers:
        return FullFirst(
            full_layers, get(name, decode_budget=decode_budget, every=every, threshold=threshold, **options)
        )
    if decode_budget is not None:
        inner = get(name, **options)
        return DecodeBudget(inner, decode_budget, DEFAULT_EVERY if every is None else every, threshold)
    for field, value in (("every", every), ("threshold", threshold)):
        if value is not None:
            raise ValueError(f"{field}={value!r} needs decode_budget= (the most tokens a layer keeps while decoding)")
    if name not in REGISTRY:
        raise ValueError(
            f"method={name!r} is not registered; choose one of {', '.join(REGISTRY)}, or register your own "
            "(kvjax.methods.register; the command lines load it with --plugin MODULE_OR_FILE)"
        )
    cls = REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"method {name!r} has no option(s) {unknown}; its options are {sorted(fields) or 'none'}")
    return cls(**options)


def takes_budget(name: str) -> bool:
    """Whether the method registered as ``name`` declares a ``budget`` field (every compressing method; ``full``
    declares none). ValueError for an unregistered name."""
    if name not in REGISTRY:
        get(name)  # the unknown-name error
    return "budget" in {f.name for f in dataclasses.fields(REGISTRY[name])}


def at_budget(name: str, budget, **options):
    """The method ``name`` at ``budget`` (a fraction or a token count) with ``options``: ``get``, the budget passed
    only to a method that declares one (:func:`takes_budget`), so ``full`` comes back as itself, the baseline a sweep
    over methods at one budget compares with.

    >>> at_budget("full", 0.2), at_budget("snapkv", 0.2).budget
    (Full(), 0.2)"""
    return get(name, **({"budget": budget} if takes_budget(name) else {}), **options)


def register(cls: type) -> type:
    """Add the method class ``cls`` to the registry under ``cls.name`` and return it (so it works as a class
    decorator). Then ``get(cls.name, ...)``, the command-line tools' ``--method`` (with ``--plugin``), the evaluation
    grid and the registry-driven tests know it. ValueError for a class that is not a dataclass subclassing
    :class:`Method` with a ``name``, or a name another class already holds. A class whose dataclass made its
    ``__eq__`` (``eq=True``, the default) gets :class:`Method`'s, which tells ``budget=1`` from ``budget=1.0``."""
    check_registrable(cls, Method, "kvjax.methods.Method", REGISTRY, "register", "method")
    if "__eq__" in cls.__dict__:  # the dataclass default compares values only (budget=1 == budget=1.0)
        cls.__eq__, cls.__hash__ = Method.__eq__, Method.__hash__
    REGISTRY[cls.name] = cls  # the same class loaded again (a plugin file run twice) replaces itself
    return cls


def load_plugin(spec: str) -> list[str]:
    """Import ``spec``, a module name (``mypackage.methods``) or a path to a ``.py`` file, whose import registers
    methods (:func:`register`); returns the names it added. FileNotFoundError or ValueError naming ``spec``."""
    before = set(REGISTRY)
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(
                f"plugin {spec!r}: no such file (a .py file or a module name that registers methods)"
            )
        name = f"kvjax_plugin_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        module_spec.loader.exec_module(module)
    else:
        try:
            importlib.import_module(spec)
        except ModuleNotFoundError as e:
            raise ValueError(f"plugin {spec!r}: {e}; pass an importable module name or a path to a .py file") from e
    return sorted(set(REGISTRY) - before)


__all__ = [
    "Capacity",
    "Chelsea",
    "ChunkKV",
    "ClusterKV",
    "DecodeBudget",
    "Full",
    "H2O",
    "Hybrid",
    "LayerContext",
    "Less",
    "Method",
    "PQCache",
    "PerLayerPlan",
    "PyramidKV",
    "Quest",
    "REGISTRY",
    "SlotCache",
    "ScoringMethod",
    "SlotMethod",
    "SnapKV",
    "StreamingLLM",
    "at_budget",
    "Window",
    "for_model",
    "get",
    "load_plugin",
    "method_of",
    "names",
    "register",
    "takes_budget",
]
