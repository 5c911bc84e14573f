"""The checks at the boundary of every method's pure functions (docs/pure-functions.md, docs/bad-inputs.md).

:class:`kvjax.methods.base.Method` wraps each subclass's ``init``, ``prefill``, ``prefill_attend``, ``decode`` and
``decode_partial`` with the functions below, so that every method, a plugin's included, checks its arguments the
same way: ``init`` records the sizes it built a state for (batch, query and KV heads, head dim, prompt bucket),
keyed by the state's structure and leaf shapes; ``prefill`` and ``decode`` compare ``q``, ``k``, ``v``,
``lengths`` and ``pos`` with them and raise a ``ValueError`` naming the argument, its shape and the expected one.
Shapes are static, so the checks run while tracing and cost nothing in a compiled program. ``lengths`` and ``pos``
given as a list, tuple or numpy array are converted to int32 arrays (their values checked: they are on the host).
A state built otherwise than by ``init`` (no record) is checked against its own batch and KV-head axes only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What ``init`` built a state for."""

    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    prompt_len: int


#: state signature -> the Sizes of every ``init`` that built a state of that signature. Configs that differ only in
#: what a state's shapes do not show (the query heads of a full cache, the bucket within the same slot count) share
#: a signature: a call is checked against whichever of them it matches, so no valid call is refused.
_SIZES: dict = {}


def _signature(state):
    leaves, tree = jax.tree.flatten(state)
    try:
        return tree, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)
    except AttributeError:  # a leaf that is not an array: nothing to key on
        return None


def record(state, model_cfg, batch, capacity):
    """Note the sizes ``init`` built ``state`` for; returns ``state``."""
    key = _signature(state)
    if key is None:
        return state
    try:
        hash(key)
    except TypeError:
        return state
    new = Sizes(batch, model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim, capacity.prompt_len)
    seen = _SIZES.setdefault(key, [])
    if new in seen:
        seen.remove(new)
    seen.append(new)  # the most recent last: the one an error message names
    return state


def _sizes(method, state, qs, ks) -> Sizes | None:
    """The recorded sizes that ``q``'s and ``k``'s shapes match (the largest bucket among them), else the most
    recent record (for the error message), else ``None``."""
    key = _signature(state)
    try:
        seen = _SIZES.get(key, []) if key is not None else []
    except TypeError:
        return None
    fits = [s for s in seen if (s.batch, s.num_heads, s.head_dim) == (qs[0], qs[1], qs[-1]) and s.num_kv_heads == ks[1]]
    if fits:
        return max(fits, key=lambda s: s.prompt_len)
    return seen[-1] if seen else None


def _state_axes(method, state) -> tuple[int | None, int | None]:
    """``(batch, kv_heads)`` of an unrecorded state from its leaves' logical axes (``Method.state_axes``)."""
    try:
        axes = jax.tree.leaves(method.state_axes(state), is_leaf=lambda a: isinstance(a, tuple))
        leaves = jax.tree.leaves(state)
    except Exception:  # noqa: BLE001 - a state this cannot read is checked no further
        return None, None
    b = h = None
    for ax, x in zip(axes, leaves):
        if len(ax) >= 1 and ax[0] == "batch" and b is None:
            b = x.shape[0]
        if len(ax) >= 2 and ax[1] == "kv_heads" and h is None:
            h = x.shape[1]
    return b, h


def _shape(name: str, x, fn: str):
    if not hasattr(x, "shape") or not hasattr(x, "ndim"):
        raise ValueError(f"{fn}: {name} is a {type(x).__name__}; pass an array (jax or numpy)")
    return tuple(x.shape)


def _int_array(name: str, x, fn: str, batch: int):
    """``x`` as an int array ``[batch]``: a list, tuple, numpy array or Python int converted (its values checked
    to be whole numbers), a jax array or tracer left as it is."""
    if isinstance(x, (bool, np.bool_)):
        raise ValueError(f"{fn}: {name}={x!r} must be an int array [batch={batch}]")
    if isinstance(x, (int, np.integer)):
        x = np.full((batch,), int(x))
    if isinstance(x, (list, tuple, np.ndarray)):
        a = np.asarray(x)
        if a.dtype.kind not in "iu":
            raise ValueError(
                f"{fn}: {name}={x!r} must hold integers (dtype {a.dtype}); pass e.g. jnp.array([...], jnp.int32)"
            )
        if a.shape != (batch,):
            raise ValueError(f"{fn}: {name} has shape {a.shape}; expected ({batch},), one entry per sequence")
        return jnp.asarray(a, jnp.int32), a
    shape = _shape(name, x, fn)
    if shape != (batch,):
        raise ValueError(f"{fn}: {name} has shape {shape}; expected ({batch},), one entry per sequence")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{fn}: {name} has dtype {x.dtype}; expected an integer array (int32)")
    return x, None


def _heads(method, state, fn: str, q, k, v, tokens: bool):
    """Check ``q [B, Hq, (T,) D]``, ``k``, ``v [B, Hkv, (T,) D]`` against each other and the state; returns
    ``(batch, T or None, sizes or None)``."""
    layout = "[batch, heads, tokens, head_dim]" if tokens else "[batch, heads, head_dim]"
    ndim = 4 if tokens else 3
    shapes = {n: _shape(n, x, fn) for n, x in (("q", q), ("k", k), ("v", v))}
    for n, s in shapes.items():
        if len(s) != ndim:
            hint = "; decode takes one token per sequence: drop the tokens axis" if not tokens and len(s) == 4 else ""
            raise ValueError(f"{fn}: {n} has shape {s}; expected {ndim} axes {layout} (head-major){hint}")
    qs, ks, vs = shapes["q"], shapes["k"], shapes["v"]
    if vs != ks:
        raise ValueError(f"{fn}: v has shape {vs}; expected k's shape {ks}")
    sizes = _sizes(method, state, qs, ks)
    if sizes is not None:
        b, hq, hkv, d = sizes.batch, sizes.num_heads, sizes.num_kv_heads, sizes.head_dim
    else:
        b, hkv = _state_axes(method, state)
        b = qs[0] if b is None else b
        hkv = ks[1] if hkv is None else hkv
        hq, d = qs[1], qs[-1]
    mid = ", T" if tokens else ""
    want_k = f"(batch={b}, kv_heads={hkv}{mid}, head_dim={d})"
    want_q = f"(batch={b}, heads={hq}{mid}, head_dim={d})"
    if ks[0] != b or ks[1] != hkv or ks[-1] != d:
        why = (
            f"; the state holds {hkv} KV heads: pass k and v unrepeated (a GQA cache never holds repeated copies)"
            if ks[1] != hkv and ks[1] % hkv == 0 and ks[1] == hq
            else f"; kvjax's layout is head-major {layout}"
            if ks[1] != hkv
            else ""
        )
        raise ValueError(f"{fn}: k has shape {ks}; expected {want_k}{why}")
    if qs[0] != b or qs[1] != hq or qs[-1] != d or (tokens and qs[2] != ks[2]):
        raise ValueError(f"{fn}: q has shape {qs}; expected {want_q}" + (f" with T={ks[2]} as k's" if tokens else ""))
    if hq % hkv:
        raise ValueError(f"{fn}: q has {hq} heads, not a multiple of k's {hkv} KV heads")
    return b, (ks[2] if tokens else None), sizes


def check_prefill(method, state, q, k, v, lengths, fn: str):
    """Checked ``lengths`` (converted to an int32 array) for ``method.prefill(state, layer, q, k, v, lengths)``."""
    fn = f"{method.name or type(method).__name__}.{fn}"
    b, t, sizes = _heads(method, state, fn, q, k, v, tokens=True)
    if sizes is not None and t > sizes.prompt_len:
        raise ValueError(
            f"{fn}: q, k, v hold {t} tokens (shape {tuple(k.shape)}) but the state was built for prompts of at most "
            f"capacity.prompt_len={sizes.prompt_len}; init it with Capacity(prompt_len>={t}, ...): prompts are "
            "never truncated"
        )
    lengths, host = _int_array("lengths", lengths, fn, b)
    if host is not None and (host.min() < 1 or host.max() > t):
        raise ValueError(f"{fn}: lengths={host.tolist()} must lie in [1, T={t}], T the tokens axis of q, k, v")
    return lengths


def check_decode(method, state, q, k, v, pos, fn: str):
    """Checked ``pos`` (converted to an int32 array) for ``method.decode(state, layer, q, k, v, pos)``."""
    fn = f"{method.name or type(method).__name__}.{fn}"
    b, _, _ = _heads(method, state, fn, q, k, v, tokens=False)
    pos, host = _int_array("pos", pos, fn, b)
    if host is not None and host.min() < 0:
        raise ValueError(f"{fn}: pos={host.tolist()} must be >= 0 (the new token's position: n, n + 1, ...)")
    return pos


def checked(name: str, f):
    """``f`` (a method's ``init``, ``prefill``, ``prefill_attend``, ``decode`` or ``decode_partial``) with the
    boundary checks in front of it."""
    if getattr(f, "_kvjax_checked", False):
        return f
    if name == "init":

        @functools.wraps(f)
        def wrapper(self, model_cfg, batch, capacity, layer, dtype, *a, **kw):
            return record(f(self, model_cfg, batch, capacity, layer, dtype, *a, **kw), model_cfg, batch, capacity)

    elif name in ("prefill", "prefill_attend"):

        @functools.wraps(f)
        def wrapper(self, state, layer, q, k, v, lengths, *a, **kw):
            lengths = check_prefill(self, state, q, k, v, lengths, name)
            return f(self, state, layer, q, k, v, lengths, *a, **kw)

    else:

        @functools.wraps(f)
        def wrapper(self, state, layer, q, k, v, pos, *a, **kw):
            pos = check_decode(self, state, q, k, v, pos, name)
            return f(self, state, layer, q, k, v, pos, *a, **kw)

    wrapper._kvjax_checked = True
    return wrapper


WRAPPED = ("init", "prefill", "prefill_attend", "decode", "decode_partial")
