"""Per-layer plans as composition: :class:`FullFirst` runs the first ``n_full`` layers with ``full`` and the rest
with an inner method.

A plan answers :meth:`~kvjax.methods.base.Method.at` (which method runs layer ``l``); the engine, eval and the
benchmarks resolve it per layer before they build, run or measure a state, and group scanned layers by it. So a
method never looks at its state's type to know what it is, and any method gets full first layers with
``methods.get(name, ..., full_layers=N)`` (ClusterKV's and Quest's own ``n_full`` answer ``at`` the same way).

The plan's other answers are the inner method's: its name, budget and declared capabilities, and, for a layer
given as an int, its ``init``/``prefill``/``decode``/``held``. What takes a state without a layer
(``tokens_held``, ``memory_bytes``, ``bytes_read_per_step``) must be asked of ``plan.at(layer)``: a TypeError
says so.
"""

from __future__ import annotations

import dataclasses

from kvjax.methods.base import LayerContext, Method
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


def refuse_full_layer(method: Method, layer: int) -> None:
    """ValueError where ``method.init`` is asked for a layer its own ``n_full`` gives to ``full``, with the fix."""
    if method.at(layer) is not method:
        raise ValueError(
            f"layer {layer} is one of {method.name}'s n_full={method.n_full} full layers: build and run it with "
            f"method.at({layer}) (the engine, eval and the benchmarks resolve every layer)"
        )


def same_as_previous(method: Method, layer: int) -> bool:
    """Whether ``layer`` runs the same method as the layer before it (``method.at``): only then does it get that
    layer's state as ``previous`` (ChunkKV's index reuse never reaches across a plan's boundary)."""
    return layer > 0 and method.at(layer - 1) == method.at(layer)


class PerLayerPlan(Method):
    """A per-layer plan over an ``inner`` method (a field of the subclass): :meth:`at` says which method runs each
    layer; every other answer is the inner method's, and what takes a state must be asked of ``plan.at(layer)``.
    :class:`FullFirst` and :class:`kvjax.methods.hybrid.Hybrid` are plans."""

    inner: Method

    # ---- the inner method's name, budget and capabilities ----
    name = property(lambda self: self.inner.name)
    budget = property(lambda self: self.inner.budget)
    recalls = property(lambda self: self.inner.recalls)
    traced_layer = property(lambda self: self.inner.traced_layer)
    attends_prompt = property(lambda self: self.inner.attends_prompt)
    reuses_previous_layer = property(lambda self: self.inner.reuses_previous_layer)
    has_decode_partial = property(lambda self: False)
    holds_exactly = property(lambda self: self.inner.holds_exactly)
    offloads = property(lambda self: self.inner.offloads)
    step_kernels = property(lambda self: self.inner.step_kernels)
    recompresses = property(lambda self: self.inner.recompresses)
    why_no_decode_budget = property(lambda self: self.inner.why_no_decode_budget)

    def min_legal_budget(self) -> int:
        return self.inner.min_legal_budget()

    def min_budget(self) -> tuple[int, str]:
        return self.inner.min_budget()

    def kept_tokens(self, n: int, max_new_tokens: int = 0, model_cfg=None) -> int:
        return self.inner.kept_tokens(n, max_new_tokens, model_cfg)

    # ---- per layer: the layer's own method ----
    def init(self, model_cfg, batch, capacity, layer, dtype):
        return self.at(layer).init(model_cfg, batch, capacity, layer, dtype)

    def prefill(self, state, layer, q, k, v, lengths, previous=None):
        return self.at(static_layer(layer, f"{type(self).__name__}.prefill")).prefill(
            state, layer, q, k, v, lengths, previous=previous
        )

    def prefill_attend(self, state, layer, q, k, v, lengths, previous=None):
        m = self.at(static_layer(layer, f"{type(self).__name__}.prefill_attend"))
        return m.prefill_attend(state, layer, q, k, v, lengths, previous=previous)

    def decode(self, state, layer, q, k, v, pos):
        return self.at(static_layer(layer, f"{type(self).__name__}.decode")).decode(state, layer, q, k, v, pos)

    def selected_positions(self, state, layer, q):
        return self.at(static_layer(layer, f"{type(self).__name__}.selected_positions")).selected_positions(
            state, layer, q
        )

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        return self.at(ctx.layer).held(n, steps, ctx)

    def held_overhead_bytes(self, model_cfg, batch, capacity, layer, dtype) -> int:
        return self.at(layer).held_overhead_bytes(model_cfg, batch, capacity, layer, dtype)

    def _per_state(self, what: str):
        raise TypeError(f"{type(self).__name__}.{what}(state): ask the layer's method, method.at(layer).{what}(state)")

    def tokens_held(self, state):
        self._per_state("tokens_held")

    def memory_bytes(self, state) -> int:
        self._per_state("memory_bytes")

    def bytes_read_per_step(self, state, num_heads: int) -> int:
        self._per_state("bytes_read_per_step")

    def state_axes(self, state):
        self._per_state("state_axes")


@dataclasses.dataclass(frozen=True, eq=False)
class FullFirst(PerLayerPlan):
    """Layers ``< n_full`` keep and attend the full cache (``full``); the others run ``inner``."""

    n_full: int
    inner: Method

    def __post_init__(self):
        if isinstance(self.n_full, bool) or not isinstance(self.n_full, int) or self.n_full < 0:
            raise ValueError(
                f"full_layers={self.n_full!r} must be an int >= 0 (leading layers that keep the full cache)"
            )
        if not isinstance(self.inner, Method):
            raise ValueError(f"FullFirst(inner={self.inner!r}): inner must be a kvjax method")
        if self.n_full and not self.inner.starts_at(self.n_full):
            raise ValueError(
                f"full_layers={self.n_full}: {self.inner.name}'s layer {self.n_full} reuses the layer before it, which "
                f"is full; use full_layers a multiple of its reuse (or reuse=1)"
            )

    def at(self, layer: int) -> Method:
        return full_below(self.n_full, static_layer(layer, "FullFirst.at"), self.inner.at(layer))
