"""The generation engine: drivers over the layer core (:mod:`kvjax.engine.core`).

- :data:`prefill` and :data:`decode_step`: the core's prefill and decode step, jitted with donated states (public
  building blocks for a user's own loop; they share their compiled programs with :func:`generate`).
- :func:`generate`: prompts in, a :class:`Result` out, over three decode drivers: ``lax.scan`` (exactly
  ``max_new_tokens`` steps), ``lax.while_loop`` (stops when every sequence has emitted EOS) and a Python loop over
  the jitted, state-donating step (``on_token`` after every step); :func:`stream` yields text from a worker thread.
  RoPE positions continue from each prompt's real length, whatever the cache holds.

Shapes are fixed by (batch, prompt bucket, ``max_new_tokens``, method): the loops compile once per bucket
and never retrace (``TRACE_COUNTS`` counts traces, for tests). Capacity is decided up front; a prompt longer
than the bucket or the model context is an error, never truncated (:mod:`kvjax.engine.prompts`).

Memory of a long process: every configuration (method, budget, batch, bucket, ``max_new_tokens``) compiles its own
programs, and JAX keeps every compiled program for the life of the process. A sweep over many configurations (an
eval run, a notebook) grows by one configuration's programs each time (on SmolLM2, hundreds of MB) unless it calls
:func:`release_compiled` between configurations, as ``kvjax-eval``'s runner does.

Sharded (:mod:`kvjax.sharding`): every function takes ``mesh`` (static; ``generate`` uses ``model.mesh``). The
states are created split over the mesh, each layer's new state is pinned to its sharding (batch over ``data``,
KV heads over ``model``) and q/k/v to theirs, and the SPMD partitioner splits the rest.

The package :mod:`kvjax.engine` re-exports these drivers with the public names of :mod:`kvjax.engine.core`,
:mod:`kvjax.engine.accounting` and :mod:`kvjax.engine.prompts`: the engine is the front users import.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import model as M
from kvjax import sharding as S
from kvjax.budget import warn_small_budget
from kvjax.config import ModelConfig
from kvjax.engine import core, prefilled as P
from kvjax.engine.accounting import Measures, held_bytes, measure, tokens_held
from kvjax.engine.core import TRACE_COUNTS, as_run, init_states
from kvjax.engine.prompts import bucket_length, check_capacity, check_method, eos_ids, pad_prompts, prepare_prompts
from kvjax.engine.prompts import until_eos, warn_without_chat
from kvjax.engine.sampling import Greedy
from kvjax.methods.base import Capacity
from kvjax.methods.plans.hybrid import describe
from kvjax.methods.plans.layers import method_of


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
    logits, states = core.decode_step(loop.cfg, loop.method, params, c.states, c.token, c.pos, loop.mesh)
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


_prefill_jit = jax.jit(core.prefill, static_argnums=(0, 1), static_argnames=("mesh",), donate_argnums=(5,))
_step_jit = jax.jit(core.decode_step, static_argnums=(0, 1), static_argnames=("mesh",), donate_argnums=(3,))
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


@dataclasses.dataclass
class Result:
    """What ``generate`` returns, per sequence."""

    text: list[str | None]
    tokens: list[list[int]]
    stats: list[dict[str, Any]]


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
    batch (:func:`kvjax.engine.prefilled.prefill_once` of the padded prompts), which this method then only compresses
    (``prefill_seconds`` is then the compression's). compress_local: on a model with local (sliding-window)
    layers, run the method on them too instead of their ring buffers of the window
    (:mod:`kvjax.methods.plans.hybrid`; the stats' ``layer_plan`` says what each kind of layer holds). track_held:
    also record the bytes each sequence holds along the generation, ``stats[i]["held_bytes_per_step"]`` (a list
    of ints: entry 0 after the prefill, entry ``s`` after decode step ``s``; the last is ``stats[i]["held_bytes"]``),
    measured as :func:`held_bytes` measures the end; it runs the decode loop step by step from Python (the
    ``"python"`` driver, a host round trip per step; same tokens) and stops where ``driver`` would. Returns a
    :class:`Result`.
    """
    if driver not in ("while", "scan", "python"):
        raise ValueError(f"driver={driver!r} must be 'while', 'scan' or 'python'")
    sampling = sampling or Greedy()
    cfg = model.config
    method = as_run(cfg, method, compress_local)  # normalised once: what follows runs it as planned
    ids = prepare_prompts(model, prompts, chat)
    lengths_list = [len(s) for s in ids]
    bucket = prompt_len or bucket_length(max(lengths_list))
    check_capacity(cfg, lengths_list, bucket, max_new_tokens)
    check_method(cfg, method)
    # on the host, once per method config: never in jit
    warn_small_budget(method_of(method), lengths_list, max_new_tokens, cfg)
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
    end = measure(method, states, cfg.num_heads)
    seconds = dict(prefill_seconds=t1 - t0, decode_seconds=t2 - t1)
    result = make_result(model, method, out, steps, eos, lengths_list, held_prefill, end, seconds)
    warn_without_chat(model, prompts, chat, result.text)
    if trace is not None:
        for i, st in enumerate(result.stats):
            st["held_bytes_per_step"] = [int(t[i]) for t in trace]
    return result


def compress_prefilled(cfg, method, prefilled, states, tokens: np.ndarray, lengths: np.ndarray):
    """This method's compression of the model's prefill of the same padded batch -> ``(states, logits)``, for
    ``generate(..., prefilled=)`` and :func:`eval.harness.answer_after_context` (ValueError for another batch's)."""
    if not P.same_batch(prefilled, tokens, lengths):
        raise ValueError(
            f"prefilled= is the prefill of another batch (tokens {tuple(prefilled.tokens.shape)}, "
            f"these prompts pad to {tokens.shape}); pass prefill_once of the same padded prompts"
        )
    return P.compress(cfg, method, prefilled, states), prefilled.logits


def make_result(model, method, out, steps: int, eos, lengths_list, held_prefill, end: Measures, seconds) -> Result:
    """:func:`generate`'s :class:`Result`: each sequence's tokens up to EOS, its text and its stats (``end``: the
    final states' :func:`~kvjax.engine.accounting.measure`, with ``bytes_read``; ``seconds``: ``prefill_seconds``
    and ``decode_seconds`` of the whole batch)."""
    held_end, held_end_bytes, b = end.tokens_held, end.held_bytes, len(lengths_list)
    result = Result([], [], [])
    for i, n in enumerate(lengths_list):
        seq = until_eos([int(x) for x in out[i, :steps]], eos)
        result.tokens.append(seq)
        result.text.append(model.tokenizer.decode(seq) if model.tokenizer is not None else None)
        result.stats.append(
            {
                "prompt_tokens": n,
                "new_tokens": len(seq),
                "method": method_of(method).name,
                "layer_plan": describe_plan(model.config, method),
                "tokens_held_prefill": float(held_prefill[i]),
                "tokens_held": float(held_end[i]),
                "cache_bytes": end.memory_bytes // b,
                "held_bytes": int(held_end_bytes[i]),
                "bytes_read_per_step": end.bytes_read // b,
                "prefill_seconds": seconds["prefill_seconds"],
                "decode_seconds": seconds["decode_seconds"],
                "decode_steps": steps,
                "tokens_per_second": steps * b / max(seconds["decode_seconds"], 1e-9),
            }
        )
    return result


def describe_plan(cfg: ModelConfig, method) -> str:
    """What each kind of layer holds under ``method`` (:func:`kvjax.methods.plans.hybrid.describe`)."""
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
