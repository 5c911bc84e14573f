"""The layer core: which method runs each layer of a model, its states, and running the layers.

- :func:`plan`: (model config, method) resolved once into a :class:`LayerPlan`: the method as it runs on the model
  (:func:`kvjax.methods.plans.hybrid.for_model`: ring buffers of the window on local layers) and each layer's own method
  (``method.at(layer)``), cached, so every entry point (the engine's drivers, :mod:`kvjax.engine.prefilled`,
  :mod:`kvjax.engine.questions`, the accounting) asks the same plan instead of rebuilding it.
- :func:`init_states`: the empty per-layer states; with ``scan_layers``, runs of agreeing layers (:func:`scan_runs`)
  become :class:`Stacked` segments run as one compiled loop body.
- :func:`run_layers`: every layer with its method state, unrolled or scanned (in place).
- :func:`prefill` and :func:`decode_step`: the traceable bodies of a prefill and of one decode step (jit them, or
  use :data:`kvjax.engine.prefill` / :data:`kvjax.engine.decode_step`, jitted with donated states);
  :data:`TRACE_COUNTS` counts their traces, for the no-retrace tests.
- :func:`method_prefill` and :func:`sliding_window`: one layer's prefill of a method and the layer's window.

Drivers over it: :mod:`kvjax.engine` (generate, the decode loops, streaming), :mod:`kvjax.engine.prefilled` (one prefill
compressed by many methods), :mod:`kvjax.engine.questions` (many questions on one compressed context); byte and token
accounting is :mod:`kvjax.engine.accounting`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.engine import inplace
from kvjax import model as M
from kvjax import sharding as S
from kvjax.budget import warn_full_attention
from kvjax.config import ModelConfig
from kvjax.methods.base import Capacity, Method
from kvjax.methods.plans.hybrid import for_model
from kvjax.methods.plans.layers import PerLayerPlan, method_of
from kvjax.model.prefill_attention import default_impl as default_prefill_impl

#: Traces of the layer core's programs by name (``prefill``, ``decode_step``, ``compress``, ``loop_scan``, ...).
TRACE_COUNTS: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """(model, method) resolved once: ``method`` as it runs on the model (a :class:`~kvjax.methods.plans.hybrid.Hybrid`
    plan on a model with local layers, else the method or plan given), ``layers[l]`` the method of layer ``l``
    (``method.at(l)``), ``windows[l]`` its sliding window (None: none). Build it with :func:`plan`."""

    method: Method | PerLayerPlan
    layers: tuple[Method, ...]
    windows: tuple

    def at(self, layer: int) -> Method:
        """Layer ``layer``'s method (a static int)."""
        return self.layers[layer]

    def same_as_previous(self, layer: int) -> bool:
        """Whether ``layer`` runs the same method as the layer before it: only then does it get that layer's state
        as ``previous`` (ChunkKV's index reuse never reaches across a plan's boundary)."""
        return layer > 0 and self.layers[layer - 1] == self.layers[layer]


@functools.lru_cache(maxsize=256)
def _plan(cfg: ModelConfig, method: Method | PerLayerPlan, compress_local: bool) -> LayerPlan:
    as_run = for_model(cfg, method, compress_local)
    return LayerPlan(as_run, tuple(as_run.at(l) for l in range(cfg.num_layers)), tuple(cfg.sliding_windows))


def plan(cfg: ModelConfig, method, compress_local: bool = False) -> LayerPlan:
    """The :class:`LayerPlan` of ``method`` (a method or a per-layer plan) on ``cfg`` (idempotent: a
    :class:`LayerPlan`, or a method already planned for ``cfg``, comes back as planned; resolved once per (config,
    method), then cached)."""
    if isinstance(method, LayerPlan):
        return method
    return _plan(cfg, method, compress_local)


def as_run(cfg: ModelConfig, method, compress_local: bool = False) -> Method | PerLayerPlan:
    """``method`` normalised once, into the form the layer core runs on ``cfg``: a registered name (None:
    ``"full"``) is built with ``methods.get``; a method or a per-layer plan becomes the plan it runs as on the model
    (:func:`kvjax.methods.plans.hybrid.for_model`: ring buffers on a model's local layers); a :class:`LayerPlan`
    gives its method. The entry points (``generate``, ``compress_context``, eval's runner and tasks) call it once;
    what they pass on is planned already, so every :func:`plan` of it below is the cached one."""
    if method is None or isinstance(method, str):
        from kvjax import methods as methods_lib  # the registry imports the engine's floor: import it when asked

        method = methods_lib.get(method or "full")
    return plan(cfg, method, compress_local).method


@struct.dataclass
class Stacked:
    """The states of layers ``[start, stop)`` stacked on a leading layer axis (every leaf ``[stop - start, ...]``):
    one segment of a scanned layer stack (:func:`scan_runs`). The engine runs these layers as one compiled loop
    body (:func:`kvjax.model.scan_layers`) and updates the stack in place, layer by layer."""

    state: Any
    start: int = struct.field(pytree_node=False)
    stop: int = struct.field(pytree_node=False)

    def layer(self, i: int):
        """Layer ``start + i``'s state (a slice; for inspection on the host)."""
        return jax.tree.map(lambda a: a[i], self.state)


def _layer_signature(st) -> tuple:
    return jax.tree.structure(st), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(st))


def scan_runs(cfg: ModelConfig, method, batch: int, capacity: Capacity, dtype) -> tuple[range, ...]:
    """Runs of consecutive layers whose states agree in structure, shapes and dtypes (abstractly, nothing is
    allocated): each run of two or more layers is scanned, each other layer unrolled. E.g. ClusterKV with
    ``n_full=2`` on 30 layers: ``(range(0, 2), range(2, 30))``; PyramidKV (a slot count per layer, rounded to a
    multiple of an eighth of its budget) gives runs of 2-3 layers. A run's layers also share their method
    (``method.at(layer)``: a per-layer plan's full layers never join a run of the inner method's)."""
    layers = plan(cfg, method)
    sigs = []
    for l in range(cfg.num_layers):
        m = layers.at(l)
        sigs.append((m, _layer_signature(jax.eval_shape(lambda: m.init(cfg, batch, capacity, l, dtype)))))
    runs, start = [], 0
    for l in range(1, cfg.num_layers + 1):
        if l == cfg.num_layers or sigs[l] != sigs[start]:
            runs.append(range(start, l))
            start = l
    return tuple(runs)


def init_states(
    cfg: ModelConfig, method, batch: int, capacity: Capacity, dtype, mesh=None, scan_layers: bool = False
) -> tuple:
    """Empty per-layer states ``(layer 0, ..., layer L-1)`` of ``method`` at ``capacity``; with a ``mesh``,
    created split over it (batch over ``data``, KV heads over ``model``).

    ``scan_layers=True``: every run of two or more consecutive layers with agreeing states (:func:`scan_runs`)
    becomes one :class:`Stacked` segment, which ``prefill``/``decode_step`` run as one compiled loop body; the
    tuple then holds segments and single-layer states in layer order (:func:`layer_states` lists them per layer).
    The method must declare ``traced_layer`` (all built-in methods do).

    On a model with local (sliding-window) layers the method runs as :func:`kvjax.methods.plans.hybrid.for_model` plans
    it: ring buffers of the window on the local layers, the method on the global ones (pass that plan to the
    measures that take no config, :mod:`kvjax.engine.accounting`'s; ``generate`` does)."""
    layers = plan(cfg, method)
    method, named = layers.method, method_of(layers.method)
    warn_full_attention(named, cfg, capacity, stacklevel=4, plan=method)  # once per method and capacity, on the host
    if scan_layers and cfg.layers_differ:
        raise ValueError(
            "scan_layers=True needs layers alike, but this model's layers differ in window/RoPE "
            f"(sliding_windows={cfg.sliding_windows}); load it with scan_layers=False"
        )
    if scan_layers and not named.traced_layer:
        raise ValueError(
            f"scan_layers=True needs a method that accepts a traced layer index (traced_layer=True); "
            f"{type(method).__name__} does not declare it, so use scan_layers=False"
        )
    runs = (
        scan_runs(cfg, layers, batch, capacity, dtype)
        if scan_layers
        else tuple(range(l, l + 1) for l in range(cfg.num_layers))
    )

    def make():
        out = []
        for run in runs:
            per = [layers.at(layer).init(cfg, batch, capacity, layer, dtype) for layer in run]
            out.append(
                per[0] if len(run) == 1 else Stacked(jax.tree.map(lambda *a: jnp.stack(a), *per), run.start, run.stop)
            )
        return tuple(out)

    if mesh is None:
        return make()
    S.check_mesh(mesh, cfg, batch)
    if named.offloads:
        raise ValueError(
            f"method {named.name!r} with offload=True keeps its K/V on one device's host memory, "
            "which does not combine with a mesh; use offload=False (the cache is then split over "
            "the mesh's devices)"
        )
    shardings = tuple(_shardings(layers.at(run.start), st, mesh) for run, st in zip(runs, jax.eval_shape(make)))
    return jax.jit(make, out_shardings=shardings)()


def _shardings(method, st, mesh):
    """The sharding of one entry of the states tuple: a layer's state, or a :class:`Stacked` segment (its
    layers' sharding with the stacked layer axis replicated)."""
    if not isinstance(st, Stacked):
        return S.state_shardings(method, st, mesh)
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), st.state)
    specs = jax.tree.map(
        lambda p: jax.sharding.NamedSharding(mesh, S.P(None, *p)),
        S.state_specs(method, one, mesh),
        is_leaf=lambda x: isinstance(x, S.P),
    )
    return Stacked(specs, st.start, st.stop)


def layer_states(states) -> list:
    """The states tuple as one state per layer (slicing :class:`Stacked` segments), for inspection."""
    out = []
    for st in states:
        out.extend(st.layer(i) for i in range(st.stop - st.start)) if isinstance(st, Stacked) else out.append(st)
    return out


def run_layers(cfg: ModelConfig, method, params, x, positions, states, step, mesh, live=None):
    """Run every layer with its method state: ``step(m, layer, x, q, k, v, state, previous) -> (attn, new_state)``,
    ``m = method.at(layer)`` the layer's method (a scanned segment's layers share theirs) (``previous``: the previous
    layer's new state for methods that declare ``reuses_previous_layer`` when that layer ran the same method, else
    None).
    Single-layer entries of ``states`` run unrolled (:func:`kvjax.model.run_layers`), :class:`Stacked` segments as
    one loop body (:func:`kvjax.model.scan_layers`) whose carry is the stack: the method runs on the traced layer's
    slice and its writes (the new token's K/V rows, evictions) go into the stack in place
    (:func:`kvjax.engine.inplace.run_on_layer`). ``live`` (prefill): the longest prompt, so bucket padding costs
    no position-wise work (:func:`kvjax.model.layer_step`). Returns ``(x, new states tuple)`` in the layout of
    ``states``."""
    layers = plan(cfg, method)
    new, layer, prev = [], 0, None
    for st in states:
        m = layers.at(layer)
        reuse = m.reuses_previous_layer
        prev = prev if layers.same_as_previous(layer) else None
        if not isinstance(st, Stacked):

            def attend(l, x, q, k, v, c, m=m, reuse=reuse, prev=prev):
                attn, out = step(m, l, x, q, k, v, st, prev if reuse else None)
                return attn, S.constrain_state(m, out, mesh)

            x, out = M.run_layers(cfg, params, x, positions, attend, None, range(layer, layer + 1), live)
            new.append(out)
            prev, layer = out, layer + 1
            continue

        def attend(l, x, q, k, v, c, st=st, m=m, reuse=reuse):
            stack, before = c

            def on_layer(one, l, x, q, k, v, before):
                attn, out = step(m, l, x, q, k, v, one, before)
                return S.constrain_state(m, out, mesh), (attn, out if reuse else None)

            # the method runs on layer l's slice of the stacks; its writes go into the stacks in place
            stack, (attn, out) = inplace.run_on_layer(on_layer, stack, l - st.start, l, x, q, k, v, before)
            return attn, (stack, out)

        first = segment_previous(st, prev, reuse)
        x, (stack, prev) = M.scan_layers(
            cfg, params, x, positions, attend, (st.state, first), range(st.start, st.stop), live
        )
        new.append(st.replace(state=stack))
        layer = st.stop
    return x, tuple(new)


def segment_previous(st: Stacked, prev, reuse: bool):
    """The ``previous`` a scanned segment's first layer gets: the layer before it when its state has the segment's
    structure and shapes, else the segment's own first (empty) state; None for a method that does not reuse."""
    if not reuse:
        return None
    first = st.layer(0)
    return prev if prev is not None and _layer_signature(prev) == _layer_signature(first) else first


def method_prefill(cfg: ModelConfig, method, layer, st, q, k, v, lengths, previous):
    """One layer's ``(attention output or None, new state)`` of ``method``'s prefill: ``prefill_attend`` for a method
    that attends the prompt itself (on layers without a sliding window, with the chunked prefill attention), else
    ``(None, prefill(...))`` and the caller computes the causal attention."""
    one_pass = method.attends_prompt and not cfg.attention_sinks  # its own attention takes no sinks
    if one_pass and sliding_window(cfg, layer) is None and default_prefill_impl() == "chunked":
        return method.prefill_attend(st, layer, q, k, v, lengths, previous=previous)  # one pass (H2O)
    return None, method.prefill(st, layer, q, k, v, lengths, previous=previous)


def pin_qkv(mesh, q, k, v):
    """Pin q ``[B, Hq, ...]`` and k, v ``[B, Hkv, ...]`` to batch over ``data`` and heads over ``model``."""
    return tuple(S.constrain(x, mesh, S.DATA, S.MODEL) for x in (q, k, v))


def prefill(cfg: ModelConfig, method, params, tokens, lengths, states, mesh=None):
    """The prefill (traceable): tokens ``[B, T]`` right-padded, lengths ``[B]`` -> (states, logits ``[B, V]`` at
    each last token). ``method``: a method or its :class:`LayerPlan`."""
    TRACE_COUNTS["prefill"] += 1
    with S.tracing(mesh):
        return _prefill_body(cfg, method, params, tokens, lengths, states, mesh)


def _prefill_body(cfg, method, params, tokens, lengths, states, mesh):
    layers = plan(cfg, method)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))

    def step(m, layer, x, q, k, v, st, previous):
        q, k, v = pin_qkv(mesh, q, k, v)
        attn, st = method_prefill(cfg, m, layer, st, q, k, v, lengths, previous)
        return (M.causal_attention(q, k, v, lengths, sliding_window(cfg, layer)) if attn is None else attn), st

    x, new_states = run_layers(
        cfg, layers, params, M.embed(params, tokens, cfg), positions, states, step, mesh, live=jnp.max(lengths)
    )
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [B, 1, H]
    return new_states, M.logits(cfg, params, last)[:, 0]


def sliding_window(cfg: ModelConfig, layer):
    """The layer's sliding window (None: none). A traced ``layer`` (a scanned segment) needs it to agree over
    the model's layers."""
    if isinstance(layer, int):
        return cfg.sliding_windows[layer]
    if cfg.layers_differ:
        raise ValueError(
            "scan_layers does not support models whose layers have different sliding windows; "
            "load the model with scan_layers=False"
        )
    return cfg.sliding_windows[0]


def decode_step(cfg: ModelConfig, method, params, states, token, pos, mesh=None):
    """One decode step (traceable): token, pos ``[B]`` -> (logits ``[B, V]``, states). ``method``: a method or its
    :class:`LayerPlan`."""
    TRACE_COUNTS["decode_step"] += 1
    with S.tracing(mesh):
        return _decode_body(cfg, method, params, states, token, pos, mesh)


def _decode_body(cfg, method, params, states, token, pos, mesh):

    def step(m, layer, x, q, k, v, st, previous):
        q, k, v = pin_qkv(mesh, q[:, :, 0], k[:, :, 0], v[:, :, 0])
        out, st = m.decode(st, layer, q, k, v, pos)
        return out[:, :, None], st

    x, new_states = run_layers(
        cfg, plan(cfg, method), params, M.embed(params, token[:, None], cfg), pos[:, None], states, step, mesh
    )
    return M.logits(cfg, params, x)[:, 0], new_states
