"""Per-layer plans as composition: a plan says which method runs each layer (:meth:`PerLayerPlan.at`) and is not a
method itself. :class:`FullFirst` runs the first ``n_full`` layers with ``full`` and the rest with an inner method;
:class:`kvjax.methods.plans.hybrid.Hybrid` runs window ring buffers on a model's local layers.

Everything that builds, runs or measures a layer's state (the engine, eval, the benchmarks) asks ``m.at(layer)``
first, and ``m`` may be a method (whose ``at`` is itself, or ``full`` below ClusterKV's and Quest's own
``n_full``) or a plan. What names ``m`` (its name, budget, declared capabilities) is :func:`method_of`'s: the
method itself, or the plan's inner method. So a method never looks at its state's type to know what it is, and any
method gets full first layers with ``methods.get(name, ..., full_layers=N)``.
"""

from __future__ import annotations

import abc
import dataclasses

from kvjax.budget import warn_full_attention
from kvjax.methods.base import Method, StaticConfig, attends_all_steps
from kvjax.methods.full import Full


def static_layer(layer, what: str) -> int:
    """``layer`` as a static int, or a TypeError naming ``what`` asked and the fix (a per-layer plan cannot answer a
    traced layer index)."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(
            f"{what}: a per-layer plan needs a static int layer (got {type(layer).__name__}); resolve it first with "
            "method.at(layer), as the engine does for every layer and scanned segment"
        )
    return layer


def full_below(n_full: int, layer: int, method: Method) -> Method:
    """``full`` for the layers below ``n_full``, else ``method``: the rule :class:`FullFirst` and ClusterKV's and
    Quest's ``n_full`` share."""
    return Full() if layer < n_full else method


class FullFirstLayers:
    """What a method whose own first ``n_full`` layers keep full attention inherits (ClusterKV §V-A, Quest: both
    skip the first two layers), before :class:`~kvjax.methods.base.Method`: :meth:`at` gives those layers to
    ``full`` (the engine builds and runs them as full layers), :meth:`attends_everything` reads the method's own
    ``attended`` count, and :meth:`compressed_layer` is the first line of the method's ``init``."""

    n_full: int

    def at(self, layer: int) -> Method:
        """Layers ``< n_full`` run ``full`` (base.Method.at)."""
        return full_below(self.n_full, layer, self)

    def attends_everything(self, model_cfg, capacity, layer: int = 0) -> bool:
        """Every decode step of a bucket-filling prompt attends every token (``attended``; base.Method)."""
        return attends_all_steps(self, model_cfg, capacity, layer)

    def compressed_layer(self, model_cfg, capacity, layer: int) -> None:
        """``init``'s check of ``layer``: a ValueError where it is one of the ``n_full`` full layers (with the fix),
        a :class:`~kvjax.budget.FullAttentionWarning` where the configuration compresses nothing on it."""
        if self.at(layer) is not self:
            raise ValueError(
                f"layer {layer} is one of {self.name}'s n_full={self.n_full} full layers: build and run it with "
                f"method.at({layer}) (the engine, eval and the benchmarks resolve every layer)"
            )
        warn_full_attention(self, model_cfg, capacity, [layer])


def same_as_previous(method, layer: int) -> bool:
    """Whether ``layer`` runs the same method as the layer before it (``method.at``; ``method`` a method or a
    plan): only then does it get that layer's state as ``previous`` (ChunkKV's index reuse never reaches across a
    plan's boundary)."""
    return layer > 0 and method.at(layer - 1) == method.at(layer)


class PerLayerPlan(StaticConfig, abc.ABC):
    """Which method runs each layer, over an ``inner`` method or plan (a field of the subclass, a frozen
    dataclass declared with ``eq=False``): :meth:`at` is all a plan answers. Not a :class:`Method`: it has no
    state, so what takes one is asked of ``plan.at(layer)``, and what names it of :func:`method_of`."""

    inner: Method | PerLayerPlan

    @abc.abstractmethod
    def at(self, layer: int) -> Method:
        """The method that runs layer ``layer`` (a static int; a TypeError for a traced one)."""


def method_of(m: Method | PerLayerPlan) -> Method:
    """The method that names ``m``, a method or a plan: its name, budget and declared capabilities (``recalls``,
    ``traced_layer``, ``offloads``, ``min_budget()``, ...). A method is its own; a plan's is its inner method's,
    through nested plans (a :class:`~kvjax.methods.plans.hybrid.Hybrid` over a :class:`FullFirst`). ValueError for
    anything else."""
    while isinstance(m, PerLayerPlan):
        m = m.inner
    if not isinstance(m, Method):
        raise ValueError(f"{m!r} is neither a kvjax method nor a per-layer plan; build one with kvjax.methods.get")
    return m


def check_inner(plan: PerLayerPlan) -> None:
    """ValueError unless ``plan.inner`` is a method or a plan."""
    if not isinstance(plan.inner, (Method, PerLayerPlan)):
        raise ValueError(f"{type(plan).__name__}(inner={plan.inner!r}): inner must be a kvjax method")


@dataclasses.dataclass(frozen=True, eq=False)
class FullFirst(PerLayerPlan):
    """Layers ``< n_full`` keep and attend the full cache (``full``); the others run ``inner.at(layer)``."""

    n_full: int
    inner: Method | PerLayerPlan

    def __post_init__(self):
        if isinstance(self.n_full, bool) or not isinstance(self.n_full, int) or self.n_full < 0:
            raise ValueError(
                f"full_layers={self.n_full!r} must be an int >= 0 (leading layers that keep the full cache)"
            )
        check_inner(self)
        if self.n_full and not self.inner.at(self.n_full).starts_at(self.n_full):
            raise ValueError(
                f"full_layers={self.n_full}: {method_of(self).name}'s layer {self.n_full} reuses the layer before it, "
                f"which is full; use full_layers a multiple of its reuse (or reuse=1)"
            )

    def at(self, layer: int) -> Method:
        return full_below(self.n_full, static_layer(layer, "FullFirst.at"), self.inner.at(layer))
