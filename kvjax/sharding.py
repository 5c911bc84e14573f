"""Beyond one device: a ``("data", "model")`` mesh, tensor-parallel parameters and head-sharded caches.

>>> mesh = kvjax.sharding.make_mesh("data=2,model=4")            # 8 devices: 2-way batch x 4-way tensor
>>> model = kvjax.load_model("/path/to/Llama-3.1-8B", mesh=mesh)  # or kvjax.shard(model, mesh)
>>> kvjax.generate(model, prompts, "snapkv")                       # prefill, decode loop, caches: all sharded

kvjax shards with JAX's SPMD partitioner (``jit`` over arrays with a ``NamedSharding``), not by rewriting any
method: every function keeps its single-device meaning and the partitioner splits it. What is split where:

- **Parameters** (:func:`param_specs`), Megatron style over ``model``: q/k/v, gate and up projections
  column-parallel (output features split), o and down projections row-parallel (input features split; XLA adds
  one all-reduce after each), the embedding and LM head split along the vocabulary (along the hidden size when
  the vocabulary does not divide), norms replicated.
- **The batch** over ``data``: tokens, lengths, positions, and axis 0 of every cache leaf.
- **Cache states** of every method over KV heads on ``model``: a method's state leaves are batch-major and
  head-major (``[B, Hkv, ...]``), and :meth:`kvjax.methods.base.Method.state_axes` names the axes of each leaf
  with the logical names :data:`BATCH` and :data:`KV_HEADS`; :data:`LOGICAL_TO_MESH` maps them to mesh axes once,
  here. Selection, merging, clustering and PQ lookup are per KV head, so they run where their heads live and the
  compiled decode step holds no all-gather of a cache buffer (``tests/sharding`` lists the collectives).
- **Fewer KV heads than the model axis** (e.g. 2 KV heads on ``model=4``): the KV heads cannot be split, so the
  k/v projections and every cache leaf are *replicated* over ``model`` (each device computes and holds all KV
  heads of its batch shard; the query heads stay split). Tokens are the same; the cache then costs each device
  the whole batch shard's cache. :func:`describe` says which applies.

A bad mesh is an error naming the axis and the fix: an unknown axis name, more devices than exist, a ``model``
size that does not divide the attention heads, a ``data`` size that does not divide the batch.

Multi-host (a TPU pod slice, several GPU hosts): call ``jax.distributed.initialize()`` in every process before
anything else, then build the same mesh over ``jax.devices()`` (all hosts' devices); each process runs the same
program (``scripts/multihost.py``, docs/architecture.md#multi-host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax.config import ModelConfig

#: Mesh axis names: the batch is split over ``data``, heads / features over ``model``.
DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)
#: Logical axis names of cache-state leaves (see ``Method.state_axes``) and the mesh axis each maps to. ``slots``
#: (a slot buffer's token axis, which :mod:`kvjax.engine.accounting` charges per held token) is never split.
BATCH, KV_HEADS, SLOTS = "batch", "kv_heads", "slots"
LOGICAL_TO_MESH = {BATCH: DATA, KV_HEADS: MODEL}


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}`` (either axis may be left out, or given as -1: it takes
    the remaining devices)."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        try:
            size = int(value)
        except ValueError:
            size = None
        if not eq or size is None:
            raise ValueError(f"mesh={text!r}: {part!r} is not AXIS=SIZE; write e.g. 'data=2,model=4'")
        if name in out:
            raise ValueError(f"mesh={text!r} names axis {name!r} twice")
        out[name] = size
    if not out:
        raise ValueError(f"mesh={text!r} is empty; write e.g. 'data=2,model=4'")
    return out


def make_mesh(spec: str | Mapping[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
    """A ``("data", "model")`` mesh. ``spec``: ``"data=2,model=4"``, ``{"data": 2, "model": 4}`` or None (all
    devices on ``data``). An axis left out (or -1) takes the remaining devices; the mesh may use fewer devices
    than exist (the first ones). ``devices`` default ``jax.devices()`` (every host's, after
    ``jax.distributed.initialize()``)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = dict(parse_mesh(spec) if isinstance(spec, str) else (spec or {DATA: -1}))
    unknown = sorted(set(sizes) - set(AXES))
    if unknown:
        raise ValueError(
            f"mesh axis {unknown[0]!r} is unknown; kvjax meshes have the axes {AXES!r} (batch over "
            f"'data', heads over 'model'), e.g. 'data=2,model=4'"
        )
    free = [a for a in AXES if sizes.get(a, -1) == -1]
    for a, n in sizes.items():
        if n != -1 and n < 1:
            raise ValueError(f"mesh axis {a!r} has size {n}; sizes are >= 1 (or -1 for the remaining devices)")
    fixed = math.prod(n for a, n in sizes.items() if n != -1)
    if len(free) == 2:
        sizes = {DATA: len(devices), MODEL: 1}
    elif free:
        if fixed > len(devices):
            raise ValueError(
                f"mesh {spec!r} needs at least {fixed} devices but {len(devices)} exist "
                f"({devices[0].platform}); use fewer"
            )
        if len(devices) % fixed:
            raise ValueError(
                f"mesh {spec!r}: the {len(devices)} devices do not split into axis {free[0]!r} with "
                f"the other axis of size {fixed}; give both sizes"
            )
        sizes[free[0]] = len(devices) // fixed
    need = sizes[DATA] * sizes[MODEL]
    if need > len(devices):
        raise ValueError(
            f"mesh data={sizes[DATA]},model={sizes[MODEL]} needs {need} devices but "
            f"{len(devices)} exist ({devices[0].platform}); use fewer (on CPU, more fake devices come "
            "from XLA_FLAGS=--xla_force_host_platform_device_count=N set before jax starts)"
        )
    grid = np.asarray(devices[:need], dtype=object).reshape(sizes[DATA], sizes[MODEL])
    return Mesh(grid, AXES)


def axis_size(mesh: Mesh | None, name: str) -> int:
    return 1 if mesh is None or name not in mesh.shape else int(mesh.shape[name])


def check_mesh(mesh: Mesh, cfg: ModelConfig, batch: int | None = None) -> None:
    """ValueErrors for a mesh this model (and batch) cannot be split over, naming the axis and the fix."""
    unknown = sorted(set(mesh.axis_names) - set(AXES))
    if unknown:
        raise ValueError(
            f"mesh axis {unknown[0]!r} is unknown; kvjax meshes have the axes {AXES!r}; build one with "
            "kvjax.sharding.make_mesh('data=..,model=..')"
        )
    tp = axis_size(mesh, MODEL)
    if cfg.num_heads % tp:
        divisors = [d for d in range(1, cfg.num_heads + 1) if cfg.num_heads % d == 0]
        raise ValueError(
            f"mesh axis 'model' has size {tp} but the model has {cfg.num_heads} attention heads, which "
            f"do not split {tp} ways; use a 'model' size in {divisors} and put the other devices on "
            "'data'"
        )
    dp = axis_size(mesh, DATA)
    if batch is not None and batch % dp:
        raise ValueError(
            f"mesh axis 'data' has size {dp} but the batch has {batch} sequences; pass a multiple of "
            f"{dp} prompts (or a mesh whose 'data' size divides {batch})"
        )


def kv_heads_split(mesh: Mesh | None, cfg: ModelConfig) -> bool:
    """Whether KV heads (k/v projections, cache leaves) are split over ``model`` (else replicated there)."""
    return cfg.num_kv_heads % axis_size(mesh, MODEL) == 0


def describe(mesh: Mesh, cfg: ModelConfig) -> str:
    dp, tp = axis_size(mesh, DATA), axis_size(mesh, MODEL)
    heads = (
        f"{cfg.num_kv_heads // tp} KV heads per device"
        if kv_heads_split(mesh, cfg)
        else f"KV heads replicated over 'model' ({cfg.num_kv_heads} KV heads do not split {tp} ways)"
    )
    return f"mesh data={dp} x model={tp}: {cfg.num_heads // tp} query heads and {heads}, batch / {dp}"


# ---------------------------------------------------------------------------------------------------------------
# Parameters


def _layer_spec(name: str, shape: tuple, cfg: ModelConfig, tp: int) -> tuple:
    """The per-layer spec (without a stacked layer axis) of parameter ``name``."""
    kv = MODEL if cfg.num_kv_heads % tp == 0 else None
    ff = MODEL if cfg.intermediate_size % tp == 0 else None
    column = {"wq": MODEL, "wk": kv, "wv": kv, "w_gate": ff, "w_up": ff}
    row = {"wo": MODEL, "w_down": ff}
    bias = {"bq": MODEL, "bk": kv, "bv": kv, "b_gate": ff, "b_up": ff}
    if name in column:
        return (None, column[name])
    if name in row:
        return (row[name], None)
    if name in bias:
        return (bias[name],)
    return (None,) * len(shape)  # norms, bo, b_down


def param_specs(cfg: ModelConfig, params, mesh: Mesh) -> Any:
    """A pytree of ``PartitionSpec`` like ``params`` (per-layer tuples or layers stacked ``[L, ...]``)."""
    tp = axis_size(mesh, MODEL)
    vocab = cfg.vocab_size % tp == 0
    hidden = cfg.hidden_size % tp == 0
    out = {}
    for key, value in params.items():
        if key == "embed":  # [V, H]
            out[key] = P(MODEL, None) if vocab else P(None, MODEL) if hidden else P()
        elif key == "lm_head":  # [H, V]
            out[key] = P(None, MODEL) if vocab else P(MODEL, None) if hidden else P()
        elif key == "layers":

            def layer(lp):
                specs = {}
                for name, w in lp.items():
                    s = _layer_spec(name, w.shape, cfg, tp)
                    specs[name] = P(*((None,) * (w.ndim - len(s)) + s))  # stacked layouts: a leading layer axis
                return specs

            out[key] = layer(value) if isinstance(value, Mapping) else tuple(layer(lp) for lp in value)
        else:
            out[key] = P()
    return out


def shard_params(cfg: ModelConfig, params, mesh: Mesh):
    """``params`` placed on ``mesh`` by :func:`param_specs` (a new pytree; the input is not modified)."""
    check_mesh(mesh, cfg)
    specs = param_specs(cfg, params, mesh)
    return jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs, is_leaf=lambda x: isinstance(x, P)
    )


def shard(model, mesh: Mesh | str | Mapping[str, int]):
    """``model`` (a :class:`kvjax.loading.Model`) with its parameters tensor-parallel on ``mesh``; ``generate``,
    the eval harness and the engine then run sharded. ``mesh`` may be a spec such as ``"data=2,model=4"``."""
    if not isinstance(mesh, Mesh):
        mesh = make_mesh(mesh)
    return dataclasses.replace(model, params=shard_params(model.config, model.params, mesh), mesh=mesh)


# ---------------------------------------------------------------------------------------------------------------
# Cache states and activations


def state_specs(method, state, mesh: Mesh) -> Any:
    """A pytree of ``PartitionSpec`` like ``state`` (one layer's method state, concrete or abstract) from the
    method's logical axes: ``batch`` over ``data``, ``kv_heads`` over ``model`` where the axis divides (else
    replicated). A batch that does not divide ``data`` is an error."""
    axes = method.state_axes(state)
    sizes = {DATA: axis_size(mesh, DATA), MODEL: axis_size(mesh, MODEL)}

    def spec(x, names):
        entries = []
        for dim, name in zip(x.shape, tuple(names) + (None,) * (x.ndim - len(names))):
            axis = LOGICAL_TO_MESH.get(name) if name is not None else None
            if axis is None or sizes[axis] == 1:
                entries.append(None)
            elif dim % sizes[axis] == 0 and dim > 0:
                entries.append(axis)
            elif name == BATCH:
                raise ValueError(
                    f"mesh axis 'data' has size {sizes[DATA]} but the batch has {dim} sequences; pass "
                    f"a multiple of {sizes[DATA]} prompts"
                )
            else:
                entries.append(None)  # KV heads that do not split: replicated over 'model' (module docstring)
        return P(*entries)

    return jax.tree.map(spec, state, axes, is_leaf=lambda x: isinstance(x, tuple) and not hasattr(x, "shape"))


def state_shardings(method, state, mesh: Mesh) -> Any:
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), state_specs(method, state, mesh), is_leaf=lambda x: isinstance(x, P)
    )


def constrain_state(method, state, mesh: Mesh | None):
    """Inside ``jit``: pin one layer's state to its sharding (no-op without a mesh)."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(method, state, mesh))


def constrain(x, mesh: Mesh | None, *spec):
    """Inside ``jit``: ``x`` split as ``spec`` (axis names; an axis that does not divide is left whole)."""
    if mesh is None:
        return x
    entries = [a if a is not None and x.shape[i] % axis_size(mesh, a) == 0 else None for i, a in enumerate(spec)]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*entries)))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Arrays whose axis 0 is the batch (tokens, lengths, positions): split over ``data``."""
    return NamedSharding(mesh, P(DATA, *(None,) * (ndim - 1)))


def put_batch(x, mesh: Mesh | None):
    """Place a batch-major array on ``mesh`` (axis 0 over ``data``); unchanged without a mesh."""
    if mesh is None:
        return x
    return jax.device_put(x, batch_sharding(mesh, np.ndim(x)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ---------------------------------------------------------------------------------------------------------------
# Several processes (jax.distributed)


def to_host(x) -> np.ndarray:
    """The whole value of ``x`` as numpy, also when it spans processes (a batch split over a ``data`` axis that
    crosses hosts): then every process gets it through ``multihost_utils.process_allgather``, a collective that
    every process must reach in the same order, as they do running the same program. Arrays this process holds
    whole (one process, or replicated) are read directly."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def host_state(state):
    """``state`` (a pytree) with every leaf that spans processes replaced by its whole numpy value
    (:func:`to_host`, collective); unchanged when this process holds every leaf whole. For host-side statistics
    that read values (``Method.bytes_read_per_step``, ``tokens_held``): one layer's state at a time, once per
    call, never inside a decode step."""
    if all(
        not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated for x in jax.tree.leaves(state)
    ):
        return state
    return jax.tree.map(lambda x: to_host(x) if isinstance(x, jax.Array) else x, state)


def is_primary() -> bool:
    """Whether this process writes results, reports and files shared by all (process 0; True with one)."""
    return jax.process_index() == 0


# ---------------------------------------------------------------------------------------------------------------
# Per-head operations the partitioner does not split by itself


def tracing(mesh: Mesh | None):
    """Context for tracing a sharded program: makes ``mesh`` the abstract mesh :func:`per_head` splits over (a
    no-op context without a mesh). The engine enters it inside its jitted functions."""
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def per_head(fn, *arrays, batch_only: Sequence[int] = ()):
    """``fn(*arrays)`` run on each device's shard of the leading ``(batch, head)`` axes of every array and
    output, under the mesh of :func:`tracing` (directly, without one). For operations that are independent per
    sequence and head but that XLA's partitioner would gather whole (``lax.top_k`` gathers its operand; a Pallas
    kernel is opaque to it). Arrays are ``[B, H, ...]`` (query heads or KV heads: a group's query heads are
    contiguous, so splitting both ``model`` ways keeps each group with its KV head); the arrays at the positions
    ``batch_only`` (and 1-D ones) are ``[B, ...]``; a None argument reaches ``fn`` as None (an optional input not
    given). Outputs are ``[B, H, ...]``. The batch axis is split over ``data`` and the head axis over ``model`` when
    they divide for every array (else that axis stays whole)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names) or mesh.size == 1:
        return fn(*arrays)
    given = [i for i, a in enumerate(arrays) if a is not None]
    present = [arrays[i] for i in given]

    def local(*xs):
        args = [None] * len(arrays)
        for i, x in zip(given, xs):
            args[i] = x
        return fn(*args)

    dp, tp = mesh.shape[DATA], mesh.shape[MODEL]
    headed = [i not in batch_only and arrays[i].ndim > 1 for i in given]
    batch = DATA if all(a.shape[0] % dp == 0 for a in present) else None
    heads = MODEL if all(a.shape[1] % tp == 0 for a, h in zip(present, headed) if h) else None
    specs = tuple(P(batch, heads) if h else P(batch) for h in headed)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(batch, heads), check_vma=False)(*present)
