"""Byte and token accounting of a method's states, per layer: what each sequence holds (tokens, bytes), what is
allocated, what the budget contract predicts, and what one decode step reads.

Each measure walks the states with each layer's own method (:func:`layer_methods`: ``method.at(layer)``, the method
that built the state) and asks it: ``tokens_held``, ``memory_bytes``, ``index_bytes``, ``bytes_read_per_step`` and
``held`` (the budget contract). ``method`` is the method as it runs on the model (:func:`kvjax.engine.core.plan`'s
``.method``, which ``generate`` passes) or its :class:`~kvjax.engine.core.LayerPlan`. :func:`measure` takes all of
them in one walk (what a result reports). :mod:`kvjax.engine` re-exports these names.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import numpy as np

from kvjax import sharding as S
from kvjax.config import ModelConfig
from kvjax.engine.core import as_run, init_states, layer_states
from kvjax.methods.base import Capacity, LayerContext


def layer_methods(method, states) -> list[tuple[Any, Any]]:
    """``(method.at(layer), state)`` for every layer (:func:`layer_states`): each state with the method that
    built it, for the per-state measures below."""
    return [(method.at(layer), st) for layer, st in enumerate(layer_states(states))]


def tokens_held(method, states) -> np.ndarray:
    """``[B]`` float: tokens each sequence holds, mean over layers (and KV heads)."""
    return np.mean([S.to_host(m.tokens_held(s)) for m, s in layer_methods(method, states)], axis=0)


def memory_bytes(method, states) -> int:
    """Bytes all layers' states hold (the batch's)."""
    return int(sum(m.memory_bytes(s) for m, s in layer_methods(method, states)))


def held_bytes(method, states) -> np.ndarray:
    """``[B]`` int: bytes each sequence holds now, over all layers; :func:`memory_bytes` is what is allocated.

    Per layer: the slots the sequence holds (``method.tokens_held``, mean over KV heads) times the bytes one slot
    costs (:func:`slot_bytes`), plus the index it has written (``method.index_bytes``: Quest's pages, PQCache's
    codes, ClusterKV's clusters; sized by the bucket, counted by what the sequence holds), plus the rest of the
    layer's state that is not per slot split evenly over the batch. The same prompt in any bucket holds the same."""
    total = sum(
        _layer_held_bytes(m, st, S.to_host(m.tokens_held(st)), S.host_state(st))
        for m, st in layer_methods(method, states)
    )
    return np.rint(total).astype(np.int64)


def _layer_held_bytes(m, st, held: np.ndarray, host) -> np.ndarray:
    """``[B]`` float: one layer's held bytes per sequence (:func:`held_bytes`), ``held`` its tokens held ``[B]``,
    ``host`` its state on this host (``S.host_state(st)``)."""
    held = held.astype(np.float64)
    fixed, per_slot = slot_bytes(m, st, held.shape[0])
    allocated, live = m.index_bytes(host)
    return fixed - allocated / held.shape[0] + live + held * per_slot


class Measures(NamedTuple):
    """What a generation reports of its states, from one walk over the layers (:func:`measure`)."""

    tokens_held: np.ndarray  #: ``[B]`` float, :func:`tokens_held`
    held_bytes: np.ndarray  #: ``[B]`` int, :func:`held_bytes`
    memory_bytes: int  #: :func:`memory_bytes` (the batch's)
    bytes_read: int | None  #: :func:`bytes_read_per_step` (the batch's); None without ``num_heads``


def measure(method, states, num_heads: int | None = None) -> Measures:
    """:func:`tokens_held`, :func:`held_bytes`, :func:`memory_bytes` and, with ``num_heads``,
    :func:`bytes_read_per_step` in one walk over the layers: each layer's counts come to the host once."""
    tokens, held, allocated, read = [], 0.0, 0, 0
    for m, st in layer_methods(method, states):
        host = S.host_state(st)
        tokens.append(S.to_host(m.tokens_held(st)))
        held = held + _layer_held_bytes(m, st, tokens[-1], host)
        allocated += m.memory_bytes(st)
        if num_heads is not None:
            read += m.bytes_read_per_step(host, num_heads)
    return Measures(
        np.mean(tokens, axis=0),
        np.rint(held).astype(np.int64),
        int(allocated),
        None if num_heads is None else int(read),
    )


def expected_held_bytes(
    cfg: ModelConfig, method, capacity: Capacity, dtype, lengths: Sequence[int], steps: int, batch: int = 1
) -> np.ndarray:
    """``[len(lengths)]`` int: the bytes a sequence with an ``n``-token prompt holds after ``steps`` decode steps
    in a cache built for ``capacity``, over all layers, from the budget contract (``method.held`` per layer) and
    the state's shapes (``jax.eval_shape`` of :func:`init_states`: nothing is allocated) — what
    :func:`held_bytes` measures at the end of a generation of ``steps + 1`` tokens, for every method whose
    contract is exact (``kvjax-eval --equal-bytes`` matches methods on it). ``batch``: the batch the state is
    built for (state without a batch axis, e.g. a step count, is split over it, as :func:`held_bytes` does)."""
    method = as_run(cfg, method)  # normalised once (a name too): what follows reads its cached plan
    states = jax.eval_shape(lambda: init_states(cfg, method, batch, capacity, dtype))
    total = np.zeros(len(lengths))
    for layer, (m, st) in enumerate(layer_methods(method, states)):
        fixed, per_slot = slot_bytes(m, st, batch)
        ctx = LayerContext(layer, cfg.num_layers, capacity, cfg)
        allocated, live = m.index_bytes(st, np.asarray(lengths, np.int64), steps)
        total += fixed - allocated / batch + live
        total += per_slot * np.array([m.held(int(n), steps, ctx) for n in lengths], np.float64)
    return np.rint(total).astype(np.int64)


def slot_bytes(method, st, batch: int) -> tuple[float, float]:
    """``(fixed, per_slot)`` for one layer's state (concrete or shapes) of ``batch`` sequences, from the slot buffer
    the method declares (``method.state_axes``: the leaves whose third axis is ``slots``, e.g. a slot cache's K, V,
    positions and scores): what one slot of it costs a sequence over its KV heads, and the bytes of the rest of the
    state per sequence (centroids, LESS's low-rank state, page summaries, PQ codes, Chelsea's outlier heads)."""
    axes = jax.tree.leaves(method.state_axes(st), is_leaf=lambda a: isinstance(a, tuple))
    declared = [x for x, ax in zip(jax.tree.leaves(st), axes) if tuple(ax)[2:3] == (S.SLOTS,)]
    slots = max((x.shape[2] for x in declared), default=0)
    per_slot = [x for x in declared if slots and x.shape[2] == slots]  # an empty score buffer [B, Hkv, 0] is not
    slot_bytes = sum(x.size * x.dtype.itemsize for x in per_slot)  # all sequences, all slots
    fixed = method.memory_bytes(st) - slot_bytes
    return fixed / batch, (slot_bytes / (batch * slots) if slots else 0.0)


def bytes_read_per_step(method, states, num_heads: int) -> int:
    """Bytes one decode step reads over all layers (the batch's), from each layer's block plan."""
    return int(sum(m.bytes_read_per_step(S.host_state(s), num_heads) for m, s in layer_methods(method, states)))
