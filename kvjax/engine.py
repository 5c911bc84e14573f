"""The generation engine: prefill, a jitted decode step, and three drivers over it.

- ``prefill``: full causal attention over the (right-padded) prompt; each layer's ``method.prefill`` stores
  or compresses its KV. Returns the per-layer states (a tuple, head-major leaves) and the next-token logits.
- ``decode_step``: one token for every sequence; each layer's ``method.decode`` appends/evicts and attends.
  RoPE positions continue from each prompt's real length, whatever the cache holds.
- Drivers: ``lax.scan`` (exactly ``max_new_tokens`` steps), ``lax.while_loop`` (stops when every sequence
  has emitted EOS) and a Python loop over the jitted, state-donating step (streams tokens).

Shapes are fixed by (batch, prompt bucket, ``max_new_tokens``, method): the loops compile once per bucket
and never retrace (``TRACE_COUNTS`` counts traces, for tests). Capacity is decided up front; a prompt longer
than the bucket or the model context is an error, never truncated.

Memory of a long process: every configuration (method, budget, batch, bucket, ``max_new_tokens``) compiles its own
programs, and JAX keeps every compiled program for the life of the process. A sweep over many configurations (an
eval run, a notebook) grows by one configuration's programs each time (on SmolLM2, hundreds of MB) unless it calls
:func:`release_compiled` between configurations, as ``kvjax-eval``'s runner does.

Sharded (:mod:`kvjax.sharding`): every function takes ``mesh`` (static; ``generate`` uses ``model.mesh``). The
states are created split over the mesh, each layer's new state is pinned to its sharding (batch over ``data``,
KV heads over ``model``) and q/k/v to theirs, and the SPMD partitioner splits the rest.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
import warnings
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import inplace, model as M
from kvjax.budget import warn_full_attention, warn_small_budget
from kvjax import sharding as S
from kvjax.config import ModelConfig
from kvjax.methods.base import Capacity, LayerContext
from kvjax.methods.hybrid import for_model
from kvjax.methods.layers import same_as_previous
from kvjax.prefill_attention import default_impl as default_prefill_impl
from kvjax.sampling import Greedy

TRACE_COUNTS: collections.Counter = collections.Counter()
MIN_BUCKET = 32


def bucket_length(n: int) -> int:
    """Prompt bucket: the next power of two >= ``n`` (at least 32)."""
    return max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


@struct.dataclass
class Stacked:
    """The states of layers ``[start, stop)`` stacked on a leading layer axis (every leaf ``[stop - start, ...]``):
    one segment of a scanned layer stack (:func:`layer_plan`). The engine runs these layers as one compiled loop
    body (:func:`kvjax.model.scan_layers`) and updates the stack in place, layer by layer."""

    state: Any
    start: int = struct.field(pytree_node=False)
    stop: int = struct.field(pytree_node=False)

    def layer(self, i: int):
        """Layer ``start + i``'s state (a slice; for inspection on the host)."""
        return jax.tree.map(lambda a: a[i], self.state)


def _layer_signature(st) -> tuple:
    return jax.tree.structure(st), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(st))


def layer_plan(cfg: ModelConfig, method, batch: int, capacity: Capacity, dtype) -> tuple[range, ...]:
    """Runs of consecutive layers whose states agree in structure, shapes and dtypes (abstractly, nothing is
    allocated): each run of two or more layers is scanned, each other layer unrolled. E.g. ClusterKV with
    ``n_full=2`` on 30 layers: ``(range(0, 2), range(2, 30))``; PyramidKV (a slot count per layer, rounded to a
    multiple of an eighth of its budget) gives runs of 2-3 layers. A run's layers also share their method
    (``method.at(layer)``: a per-layer plan's full layers never join a run of the inner method's)."""
    method = for_model(cfg, method)
    sigs = []
    for l in range(cfg.num_layers):
        m = method.at(l)
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

    ``scan_layers=True``: every run of two or more consecutive layers with agreeing states (:func:`layer_plan`)
    becomes one :class:`Stacked` segment, which ``prefill``/``decode_step`` run as one compiled loop body; the
    tuple then holds segments and single-layer states in layer order (:func:`layer_states` lists them per layer).
    The method must declare ``traced_layer`` (all built-in methods do).

    On a model with local (sliding-window) layers the method runs as :func:`kvjax.methods.hybrid.for_model` plans
    it: ring buffers of the window on the local layers, the method on the global ones (pass that plan to the
    measures that take no config, :func:`memory_bytes`, :func:`held_bytes`, ...; ``generate`` does)."""
    method = for_model(cfg, method)
    warn_full_attention(method, cfg, capacity, stacklevel=4)  # once per method and capacity, on the host
    if scan_layers and cfg.layers_differ:
        raise ValueError(
            "scan_layers=True needs layers alike, but this model's layers differ in window/RoPE "
            f"(sliding_windows={cfg.sliding_windows}); load it with scan_layers=False"
        )
    if scan_layers and not method.traced_layer:
        raise ValueError(
            f"scan_layers=True needs a method that accepts a traced layer index (traced_layer=True); "
            f"{type(method).__name__} does not declare it, so use scan_layers=False"
        )
    plan = (
        layer_plan(cfg, method, batch, capacity, dtype)
        if scan_layers
        else tuple(range(l, l + 1) for l in range(cfg.num_layers))
    )

    def make():
        out = []
        for run in plan:
            per = [method.at(layer).init(cfg, batch, capacity, layer, dtype) for layer in run]
            out.append(
                per[0] if len(run) == 1 else Stacked(jax.tree.map(lambda *a: jnp.stack(a), *per), run.start, run.stop)
            )
        return tuple(out)

    if mesh is None:
        return make()
    S.check_mesh(mesh, cfg, batch)
    if method.offloads:
        raise ValueError(
            f"method {method.name!r} with offload=True keeps its K/V on one device's host memory, "
            "which does not combine with a mesh; use offload=False (the cache is then split over "
            "the mesh's devices)"
        )
    shardings = tuple(_shardings(method.at(run.start), st, mesh) for run, st in zip(plan, jax.eval_shape(make)))
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


def _method_layers(cfg: ModelConfig, method, params, x, positions, states, step, mesh, live=None):
    """Run every layer with its method state: ``step(m, layer, x, q, k, v, state, previous) -> (attn, new_state)``,
    ``m = method.at(layer)`` the layer's method (a scanned segment's layers share theirs) (``previous``: the previous
    layer's new state for methods that declare ``reuses_previous_layer`` when that layer ran the same method, else
    None).
    Single-layer entries of ``states`` run unrolled (:func:`kvjax.model.run_layers`), :class:`Stacked` segments as
    one loop body (:func:`kvjax.model.scan_layers`) whose carry is the stack: the method runs on the traced layer's
    slice and its writes (the new token's K/V rows, evictions) go into the stack in place
    (:func:`kvjax.inplace.run_on_layer`). ``live`` (prefill): the longest prompt's length, so bucket padding costs
    no position-wise work (:func:`kvjax.model.layer_step`). Returns ``(x, new states tuple)`` in the layout of
    ``states``."""
    new, layer, prev = [], 0, None
    for st in states:
        m = method.at(layer)
        reuse = m.reuses_previous_layer
        prev = prev if same_as_previous(method, layer) else None
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
    if one_pass and _sliding_window(cfg, layer) is None and default_prefill_impl() == "chunked":
        return method.prefill_attend(st, layer, q, k, v, lengths, previous=previous)  # one pass (H2O)
    return None, method.prefill(st, layer, q, k, v, lengths, previous=previous)


def _qkv(mesh, q, k, v):
    """Pin q ``[B, Hq, ...]`` and k, v ``[B, Hkv, ...]`` to batch over ``data`` and heads over ``model``."""
    return tuple(S.constrain(x, mesh, S.DATA, S.MODEL) for x in (q, k, v))


def _prefill(cfg: ModelConfig, method, params, tokens, lengths, states, mesh=None):
    """tokens ``[B, T]`` right-padded, lengths ``[B]`` -> (states, logits ``[B, V]`` at each last token)."""
    TRACE_COUNTS["prefill"] += 1
    with S.tracing(mesh):
        return _prefill_body(cfg, method, params, tokens, lengths, states, mesh)


def _prefill_body(cfg, method, params, tokens, lengths, states, mesh):
    method = for_model(cfg, method)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))

    def step(m, layer, x, q, k, v, st, previous):
        q, k, v = _qkv(mesh, q, k, v)
        attn, st = method_prefill(cfg, m, layer, st, q, k, v, lengths, previous)
        return (M.causal_attention(q, k, v, lengths, _sliding_window(cfg, layer)) if attn is None else attn), st

    x, new_states = _method_layers(
        cfg, method, params, M.embed(params, tokens, cfg), positions, states, step, mesh, live=jnp.max(lengths)
    )
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [B, 1, H]
    return new_states, M.logits(cfg, params, last)[:, 0]


def _sliding_window(cfg: ModelConfig, layer):
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


def _decode_step(cfg: ModelConfig, method, params, states, token, pos, mesh=None):
    """token, pos ``[B]`` -> (logits ``[B, V]``, states)."""
    TRACE_COUNTS["decode_step"] += 1
    with S.tracing(mesh):
        return _decode_body(cfg, method, params, states, token, pos, mesh)


def _decode_body(cfg, method, params, states, token, pos, mesh):
    method = for_model(cfg, method)

    def step(m, layer, x, q, k, v, st, previous):
        q, k, v = _qkv(mesh, q[:, :, 0], k[:, :, 0], v[:, :, 0])
        out, st = m.decode(st, layer, q, k, v, pos)
        return out[:, :, None], st

    x, new_states = _method_layers(
        cfg, method, params, M.embed(params, token[:, None], cfg), pos[:, None], states, step, mesh
    )
    return M.logits(cfg, params, x)[:, 0], new_states


@dataclasses.dataclass(frozen=True)
class DecodeLoop:
    """Static description of a decode loop (hashable: part of the jit cache key)."""

    cfg: ModelConfig
    method: Any
    sampling: Any
    max_new_tokens: int
    eos: tuple[int, ...]
    mesh: Any = None


@struct.dataclass
class DecodeCarry:
    """The decode loop's carry: method states (per layer), the last token and its position ``[B]``, which
    sequences are done ``[B]``, the sampling key, the step count and the generated tokens ``[B, max_new]``."""

    states: tuple
    token: jnp.ndarray
    pos: jnp.ndarray
    done: jnp.ndarray
    key: jnp.ndarray
    step: jnp.ndarray
    out: jnp.ndarray


def _loop_body(loop: DecodeLoop, params, c: DecodeCarry) -> DecodeCarry:
    key, sub = jax.random.split(c.key)
    logits, states = _decode_step(loop.cfg, loop.method, params, c.states, c.token, c.pos, loop.mesh)
    nxt = jnp.where(c.done, c.token, loop.sampling(logits, sub))
    out = jax.lax.dynamic_update_slice(c.out, nxt[:, None], (0, c.step))
    is_eos = jnp.isin(nxt, jnp.asarray(loop.eos, jnp.int32)) if loop.eos else jnp.zeros_like(c.done)
    return DecodeCarry(states, nxt, c.pos + 1, c.done | is_eos, key, c.step + 1, out)


@functools.partial(jax.jit, static_argnames=("loop", "driver"), donate_argnames=("states",))
def run_loop(loop: DecodeLoop, driver: str, params, states, first, lengths, key):
    """Run the whole decode loop compiled (``driver``: ``"scan"``, exactly ``max_new_tokens`` tokens, or
    ``"while"``, stop when every sequence has emitted EOS). ``first [B]`` is the token sampled from the prefill
    logits, ``lengths [B]`` the prompt lengths (its position). Returns ``(tokens [B, max_new_tokens], steps,
    states)``; ``states`` is donated."""
    TRACE_COUNTS[f"loop_{driver}"] += 1
    b = first.shape[0]
    out = jnp.zeros((b, loop.max_new_tokens), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, jnp.asarray(loop.eos, jnp.int32)) if loop.eos else jnp.zeros((b,), bool)
    carry = DecodeCarry(states, first, lengths, done, key, jnp.int32(1), out)
    n = loop.max_new_tokens - 1
    if driver == "scan":
        carry, _ = jax.lax.scan(lambda c, _: (_loop_body(loop, params, c), None), carry, None, length=n)
    else:
        carry = jax.lax.while_loop(
            lambda c: (c.step <= n) & ~jnp.all(c.done), lambda c: _loop_body(loop, params, c), carry
        )
    return carry.out, carry.step, carry.states


class _MeshByKeyword:
    """A jitted function of six arguments and ``mesh``, always called with ``mesh`` by keyword. jit keys its compiled
    programs on how the arguments are passed, so ``prefill(..., states)`` and ``prefill(..., states, mesh=None)``
    (what :func:`generate` passes) compiled the same program twice: a user's loop beside ``generate`` paid each
    compilation twice (without a persistent compilation cache). ``lower`` and ``trace`` as jit's; the rest of jit's
    attributes pass through."""

    def __init__(self, jitted):
        self._jitted = jitted
        functools.update_wrapper(self, jitted)

    @staticmethod
    def _split(args, mesh):
        if len(args) == 7:  # mesh given as the seventh positional argument
            args, mesh = args[:6], args[6]
        return args, mesh

    def __call__(self, *args, mesh=None):
        args, mesh = self._split(args, mesh)
        return self._jitted(*args, mesh=mesh)

    def lower(self, *args, mesh=None):
        args, mesh = self._split(args, mesh)
        return self._jitted.lower(*args, mesh=mesh)

    def trace(self, *args, mesh=None):
        args, mesh = self._split(args, mesh)
        return self._jitted.trace(*args, mesh=mesh)

    def __getattr__(self, name):
        return getattr(self._jitted, name)


_prefill_jit = jax.jit(_prefill, static_argnums=(0, 1), static_argnames=("mesh",), donate_argnums=(5,))
_step_jit = jax.jit(_decode_step, static_argnums=(0, 1), static_argnames=("mesh",), donate_argnums=(3,))
#: Public, jitted building blocks for users' own loops (states are donated):
#: ``prefill(cfg, method, params, tokens [B,T], lengths [B], states, mesh=None) -> (states, logits [B,V])`` and
#: ``decode_step(cfg, method, params, states, token [B], pos [B], mesh=None) -> (logits [B,V], states)``.
#: With a mesh, pass sharded params (:func:`kvjax.shard`) and states (``init_states(..., mesh=mesh)``). Each
#: shares its compiled programs with :func:`generate` (``driver="python"`` for ``decode_step``).
prefill = _MeshByKeyword(_prefill_jit)
decode_step = _MeshByKeyword(_step_jit)


def release_compiled() -> None:
    """Free what finished configurations hold: every compiled program and trace JAX caches (``jax.clear_caches``,
    which also drops the caller's own jitted programs; they recompile on their next call), then Python garbage and,
    with glibc, the freed heap pages (``malloc_trim``: without it the allocator keeps the pages of freed programs
    and buffers and the process's resident memory still grows). Call it between configurations of a sweep; the next
    ``generate`` recompiles its configuration. Arrays the caller still references (parameters, states) stay."""
    import ctypes
    import gc

    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): the allocator keeps its pages
        pass


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
    costs (:func:`_slot_bytes`), plus the index it has written (``method.index_bytes``: Quest's pages, PQCache's
    codes, ClusterKV's clusters; sized by the bucket, counted by what the sequence holds), plus the rest of the
    layer's state that is not per slot split evenly over the batch. The same prompt in any bucket holds the same."""
    total = 0.0
    for m, st in layer_methods(method, states):
        held = S.to_host(m.tokens_held(st)).astype(np.float64)
        fixed, per_slot = _slot_bytes(m, st, held.shape[0])
        allocated, live = m.index_bytes(S.host_state(st))
        total = total + fixed - allocated / held.shape[0] + live + held * per_slot
    return np.rint(total).astype(np.int64)


def expected_held_bytes(
    cfg: ModelConfig, method, capacity: Capacity, dtype, lengths: Sequence[int], steps: int, batch: int = 1
) -> np.ndarray:
    """``[len(lengths)]`` int: the bytes a sequence with an ``n``-token prompt holds after ``steps`` decode steps
    in a cache built for ``capacity``, over all layers, from the budget contract (``method.held`` per layer) and
    the state's shapes (``jax.eval_shape`` of :func:`init_states`: nothing is allocated) — what
    :func:`held_bytes` measures at the end of a generation of ``steps + 1`` tokens, for every method whose
    contract is exact (``kvjax-eval --equal-bytes`` matches methods on it). ``batch``: the batch the state is
    built for (state without a batch axis, e.g. a step count, is split over it, as :func:`held_bytes` does)."""
    method = for_model(cfg, method)
    states = jax.eval_shape(lambda: init_states(cfg, method, batch, capacity, dtype))
    total = np.zeros(len(lengths))
    for layer, (m, st) in enumerate(layer_methods(method, states)):
        fixed, per_slot = _slot_bytes(m, st, batch)
        ctx = LayerContext(layer, cfg.num_layers, capacity, cfg)
        allocated, live = m.index_bytes(st, np.asarray(lengths, np.int64), steps)
        total += fixed - allocated / batch + live
        total += per_slot * np.array([m.held(int(n), steps, ctx) for n in lengths], np.float64)
    return np.rint(total).astype(np.int64)


def _slot_bytes(method, st, batch: int) -> tuple[float, float]:
    """``(fixed, per_slot)`` for one layer's state (concrete or shapes) of ``batch`` sequences: the bytes of the
    state that is not per slot (centroids, LESS's low-rank state, page summaries, counts) per sequence, and what
    one slot costs a sequence over its KV heads (every ``[B, Hkv, S, ...]`` leaf: K, V, positions, scores, PQ
    codes, cluster ids). ``S`` is the slot axis of the largest ``[B, Hkv, S, D]`` leaf; a method whose layers keep
    two slot buffers of different lengths (Chelsea's outlier heads) is counted at the main buffer's slot cost,
    and its other buffer as fixed."""
    leaves = [x for x in jax.tree.leaves(st) if hasattr(x, "shape")]
    slots = max((x.shape[2] for x in leaves if x.ndim == 4 and x.shape[0] == batch), default=0)
    per_slot = [x for x in leaves if slots and x.ndim >= 3 and x.shape[0] == batch and x.shape[2] == slots]
    slot_bytes = sum(x.size * x.dtype.itemsize for x in per_slot)  # all sequences, all slots
    fixed = method.memory_bytes(st) - slot_bytes
    return fixed / batch, (slot_bytes / (batch * slots) if slots else 0.0)


def bytes_read_per_step(method, states, num_heads: int) -> int:
    """Bytes one decode step reads over all layers (the batch's), from each layer's block plan."""
    return int(sum(m.bytes_read_per_step(S.host_state(s), num_heads) for m, s in layer_methods(method, states)))


@dataclasses.dataclass
class Result:
    """What ``generate`` returns, per sequence."""

    text: list[str | None]
    tokens: list[list[int]]
    stats: list[dict[str, Any]]


def prepare_prompts(model, prompts, chat: bool = False) -> list[list[int]]:
    """Token id lists from a string, strings (tokenized; ``chat=True`` applies the chat template) or id lists."""
    if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if len(prompts) == 0:
        raise ValueError("prompts=[] is empty; pass a string, a list of strings or a list of token id lists")
    ids = []
    for p in prompts:
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError(
                    "prompts are strings but this model was loaded without a tokenizer; pass token "
                    "id lists or load a checkpoint with tokenizer files"
                )
            ids.append(
                model.tokenizer.encode_chat([{"role": "user", "content": p}])
                if chat
                else model.tokenizer.encode(p, add_special_tokens=True)
            )
        else:
            ids.append([int(i) for i in p])
        if not ids[-1]:
            raise ValueError("an empty prompt cannot be generated from; give at least one token")
    return ids


class ChatTemplateWarning(UserWarning):
    """Strings were tokenized without the chat template of a model that has one, and an answer came out empty
    (:func:`warn_without_chat`)."""


def warn_without_chat(model, prompts, chat: bool, texts, argument: str = "chat") -> bool:
    """Warn (:class:`ChatTemplateWarning`) when string ``prompts`` were tokenized without the model's chat template
    (``chat=False``) and some output in ``texts`` is empty: an instruct model given raw text often ends at once.
    Returns whether it warned."""
    tok = model.tokenizer
    strings = isinstance(prompts, str) or any(isinstance(p, str) for p in prompts)
    if chat or not strings or tok is None or tok.chat_template is None or all(t for t in texts):
        return False
    empty = sum(1 for t in texts if not t)
    warnings.warn(
        f"{empty} of {len(texts)} outputs are empty: the prompts were tokenized without this model's chat template "
        f"({argument}=False) and an instruct model often ends at once on raw text; pass {argument}=True",
        ChatTemplateWarning,
        stacklevel=3,
    )
    return True


def check_method(cfg: ModelConfig, method) -> None:
    """A ValueError when the method's token budget exceeds the model context (the fix: a smaller count)."""
    from kvjax.budget import check_budget

    if method.budget is not None:  # declared (base.Method.budget); the method validated its type and range
        check_budget(method.budget, "budget", max_tokens=cfg.max_position_embeddings)


def _check_capacity(cfg: ModelConfig, lengths: Sequence[int], bucket: int, max_new_tokens: int):
    longest = max(lengths)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if longest > bucket:
        raise ValueError(
            f"prompt of {longest} tokens is longer than capacity prompt_len={bucket}; raise "
            "prompt_len (or leave it None to bucket automatically); prompts are never truncated"
        )
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model context "
            f"of {cfg.max_position_embeddings} tokens; shorten the prompt or generate fewer tokens"
        )


def until_eos(tokens: list[int], eos) -> list[int]:
    """``tokens`` up to (not including) the first one in ``eos``."""
    cut = next((j for j, tok in enumerate(tokens) if tok in eos), len(tokens))
    return tokens[:cut]


def eos_ids(model) -> tuple[int, ...]:
    """The token ids that end a generation: the model config's and the tokenizer's end-of-sequence ids."""
    ids = set(model.config.eos_token_ids)
    if model.tokenizer is not None:
        ids |= set(model.tokenizer.eos_token_ids)
    return tuple(sorted(ids))


def pad_prompts(ids: list[list[int]], bucket: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad id lists to ``bucket`` (default :func:`bucket_length` of the longest): ``(tokens [B, bucket]
    int32, lengths [B] int32)``. A prompt longer than ``bucket`` is an error, never truncated."""
    longest = max(len(s) for s in ids)
    bucket = bucket or bucket_length(longest)
    if longest > bucket:
        raise ValueError(
            f"prompt of {longest} tokens is longer than prompt_len={bucket}; raise prompt_len (or "
            "leave it None to bucket automatically); prompts are never truncated"
        )
    tokens = np.zeros((len(ids), bucket), np.int32)
    for i, seq in enumerate(ids):
        tokens[i, : len(seq)] = seq
    return tokens, np.asarray([len(s) for s in ids], np.int32)


def generate(
    model,
    prompts,
    method=None,
    max_new_tokens: int = 64,
    sampling=None,
    *,
    chat: bool = False,
    seed: int = 0,
    driver: str = "while",
    prompt_len: int | None = None,
    stop_at_eos: bool = True,
    on_token=None,
    prefilled=None,
    compress_local: bool = False,
    track_held: bool = False,
) -> Result:
    """Generate continuations of ``prompts`` with a (compressed) KV cache.

    prompts: a string, a list of strings (tokenized; ``chat=True`` applies the chat template) or lists of
    token ids. method: a method config (``kvjax.methods.get(...)``) or a registered name; default ``full``.
    sampling: ``Greedy()`` (default) or ``Sample(...)``. driver: ``"while"`` (stop at EOS), ``"scan"``
    (exactly ``max_new_tokens``) or ``"python"`` (streams: ``on_token(step, tokens[B])`` after every step).
    prompt_len: the prompt bucket (default: next power of two). prefilled: the model's prefill of this very
    batch (:func:`kvjax.prefilled.prefill_once` of the padded prompts), which this method then only compresses
    (``prefill_seconds`` is then the compression's). compress_local: on a model with local (sliding-window)
    layers, run the method on them too instead of their ring buffers of the window
    (:mod:`kvjax.methods.hybrid`; the stats' ``layer_plan`` says what each kind of layer holds). track_held:
    also record the bytes each sequence holds along the generation, ``stats[i]["held_bytes_per_step"]`` (a list
    of ints: entry 0 after the prefill, entry ``s`` after decode step ``s``; the last is ``stats[i]["held_bytes"]``),
    measured as :func:`held_bytes` measures the end; it runs the decode loop step by step from Python (the
    ``"python"`` driver, a host round trip per step; same tokens) and stops where ``driver`` would. Returns a
    :class:`Result`.
    """
    from kvjax import methods as methods_lib

    if method is None or isinstance(method, str):
        method = methods_lib.get(method or "full")
    if driver not in ("while", "scan", "python"):
        raise ValueError(f"driver={driver!r} must be 'while', 'scan' or 'python'")
    sampling = sampling or Greedy()
    cfg = model.config
    method = for_model(cfg, method, compress_local)
    ids = prepare_prompts(model, prompts, chat)
    lengths_list = [len(s) for s in ids]
    bucket = prompt_len or bucket_length(max(lengths_list))
    _check_capacity(cfg, lengths_list, bucket, max_new_tokens)
    check_method(cfg, method)
    warn_small_budget(method, lengths_list, max_new_tokens, cfg)  # on the host, once per method config: never in jit
    tokens, lengths = pad_prompts(ids, bucket)
    capacity = Capacity(bucket, max_new_tokens)
    eos = eos_ids(model) if stop_at_eos else ()
    mesh = model.mesh
    states = init_states(cfg, method, len(ids), capacity, model.dtype, mesh, scan_layers=M.is_stacked(model.params))
    tokens_d, lengths_d = S.put_batch(jnp.asarray(tokens), mesh), S.put_batch(jnp.asarray(lengths), mesh)

    t0 = time.perf_counter()
    if prefilled is None:
        states, logits = _prefill_jit(cfg, method, model.params, tokens_d, lengths_d, states, mesh=mesh)
    else:
        states, logits = compress_prefilled(cfg, method, prefilled, states, tokens, lengths)
    key, sub = jax.random.split(jax.random.PRNGKey(seed))
    first = sampling(logits, sub)
    first.block_until_ready()
    t1 = time.perf_counter()
    cache_bytes = memory_bytes(method, states)
    held_prefill = tokens_held(method, states)
    loop = DecodeLoop(cfg, method, sampling, max_new_tokens, eos, mesh)
    trace = [held_bytes(method, states)] if track_held else None
    if driver == "python" or track_held:
        on_states = None if trace is None else (lambda st: trace.append(held_bytes(method, st)))
        out, steps, states = _python_loop(
            loop, model.params, states, first, lengths_d, key, on_token, on_states, until_done=driver != "scan"
        )
    else:
        out, steps, states = run_loop(loop, driver, model.params, states, first, lengths_d, key)
        out = S.to_host(out)
        steps = int(S.to_host(steps))
    t2 = time.perf_counter()
    shared = dict(
        prefill_seconds=t1 - t0, decode_seconds=t2 - t1, read=bytes_read_per_step(method, states, cfg.num_heads)
    )
    result = _result(model, method, out, steps, eos, lengths_list, held_prefill, states, cache_bytes, shared)
    warn_without_chat(model, prompts, chat, result.text)
    if trace is not None:
        for i, st in enumerate(result.stats):
            st["held_bytes_per_step"] = [int(t[i]) for t in trace]
    return result


def compress_prefilled(cfg, method, prefilled, states, tokens: np.ndarray, lengths: np.ndarray):
    """This method's compression of the model's prefill of the same padded batch -> ``(states, logits)``, for
    ``generate(..., prefilled=)`` and :func:`eval.harness.answer_after_context` (ValueError for another batch's)."""
    from kvjax import prefilled as P

    if not P.same_batch(prefilled, tokens, lengths):
        raise ValueError(
            f"prefilled= is the prefill of another batch (tokens {tuple(prefilled.tokens.shape)}, "
            f"these prompts pad to {tokens.shape}); pass prefill_once of the same padded prompts"
        )
    return P.compress(cfg, method, prefilled, states), prefilled.logits


def _result(model, method, out, steps: int, eos, lengths_list, held_prefill, states, cache_bytes, shared) -> Result:
    """:func:`generate`'s :class:`Result`: each sequence's tokens up to EOS, its text and its stats (``shared``:
    the prefill and decode seconds and the bytes read per step of the whole batch)."""
    held_end, held_end_bytes, b = tokens_held(method, states), held_bytes(method, states), len(lengths_list)
    result = Result([], [], [])
    for i, n in enumerate(lengths_list):
        seq = until_eos([int(x) for x in out[i, :steps]], eos)
        result.tokens.append(seq)
        result.text.append(model.tokenizer.decode(seq) if model.tokenizer is not None else None)
        result.stats.append(
            {
                "prompt_tokens": n,
                "new_tokens": len(seq),
                "method": method.name,
                "layer_plan": describe_plan(model.config, method),
                "tokens_held_prefill": float(held_prefill[i]),
                "tokens_held": float(held_end[i]),
                "cache_bytes": cache_bytes // b,
                "held_bytes": int(held_end_bytes[i]),
                "bytes_read_per_step": shared["read"] // b,
                "prefill_seconds": shared["prefill_seconds"],
                "decode_seconds": shared["decode_seconds"],
                "decode_steps": steps,
                "tokens_per_second": steps * b / max(shared["decode_seconds"], 1e-9),
            }
        )
    return result


def describe_plan(cfg: ModelConfig, method) -> str:
    """What each kind of layer holds under ``method`` (:func:`kvjax.methods.hybrid.describe`)."""
    from kvjax.methods.hybrid import describe

    return describe(cfg, method)


def _python_loop(loop: DecodeLoop, params, states, first, lengths, key, on_token, on_states=None, until_done=True):
    """The decode loop from Python, one jitted step at a time: ``on_token(step, tokens [B])`` after every token,
    ``on_states(states)`` after every decode step; stops at ``max_new_tokens`` or, with ``until_done``, when every
    sequence has emitted EOS (as the ``while`` driver; ``until_done=False`` runs every step, as ``scan``)."""
    b = first.shape[0]
    out = np.zeros((b, loop.max_new_tokens), np.int32)
    out[:, 0] = S.to_host(first)
    eos = np.asarray(loop.eos, np.int32)
    done = np.isin(out[:, 0], eos)
    token, pos = first, lengths
    if on_token is not None:
        on_token(0, out[:, 0])
    step = 1
    while step < loop.max_new_tokens and not (until_done and done.all()):
        key, sub = jax.random.split(key)
        logits, states = _step_jit(loop.cfg, loop.method, params, states, token, pos, mesh=loop.mesh)
        if on_states is not None:
            on_states(states)
        nxt = S.to_host(loop.sampling(logits, sub))
        nxt = np.where(done, out[:, step - 1], nxt)
        out[:, step] = nxt
        done |= np.isin(nxt, eos)
        if on_token is not None:
            on_token(step, nxt)
        token, pos = S.put_batch(jnp.asarray(nxt), loop.mesh), pos + 1
        step += 1
    return out, step, states


def stream(model, prompt, method=None, max_new_tokens: int = 64, sampling=None, **kw) -> Iterator[str]:
    """Yield the decoded text of one prompt piece by piece (Python driver).

    ``generate`` runs in a worker thread; an exception it raises there (a bad ``max_new_tokens``, a prompt longer
    than the model context, ...) is re-raised here, in the caller's thread, when the stream reaches it."""
    import queue
    import threading

    q: queue.Queue = queue.Queue()
    seq: list[int] = []
    eos = set(eos_ids(model))
    failed: list[BaseException] = []

    def on_token(step, toks):
        q.put(int(toks[0]))

    def run():
        try:
            generate(model, [prompt], method, max_new_tokens, sampling, driver="python", on_token=on_token, **kw)
        except BaseException as e:  # handed to the consumer: a thread's exception would only be printed
            failed.append(e)
        finally:
            q.put(None)

    threading.Thread(target=run, daemon=True).start()
    shown = ""
    while (tok := q.get()) is not None:
        if tok in eos:
            continue
        seq.append(tok)
        text = model.tokenizer.decode(seq)
        if not text.endswith("\ufffd"):  # wait for complete UTF-8 characters
            yield text[len(shown) :]
            shown = text
    if failed:
        raise failed[0]
