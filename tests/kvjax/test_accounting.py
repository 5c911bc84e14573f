"""Byte accounting asks each method for its slot buffer (``Method.state_axes``'s ``slots`` axis) and charges each held
token one slot of it: bracketed here by what a token must cost (its K and V rows over the KV heads) and may cost
(plus a position and a score per head), for every registered method; the rest of the state is fixed, never negative.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from kvjax.engine import accounting
from kvjax import engine, methods
from kvjax.config import ModelConfig
from kvjax.methods.base import Capacity
from methods_table import small

CFG = ModelConfig("llama", 64, 64, 96, 2, 4, 2, 16, max_position_embeddings=1024)


@pytest.mark.parametrize("name", methods.names())
@pytest.mark.parametrize("cap", [Capacity(64, 8), Capacity(256, 16)], ids=["64", "256"])
def test_each_method_declares_its_slot_buffer(name, cap):
    m = small(name)
    states = jax.eval_shape(lambda: engine.init_states(CFG, m, 2, cap, jnp.float32))
    kv = 2 * CFG.num_kv_heads * CFG.head_dim * 4  # a token's K and V rows, float32, over the KV heads
    for layer, (lm, st) in enumerate(accounting.layer_methods(m, states)):
        fixed, per_slot = accounting.slot_bytes(lm, st, 2)
        assert kv <= per_slot <= kv + 2 * 4 * CFG.num_kv_heads, (layer, type(lm).__name__, per_slot)
        assert fixed >= 0, (layer, type(lm).__name__, fixed)


def test_an_undeclared_slot_buffer_is_charged_as_fixed():
    """A state whose method declares no ``slots`` axis is all fixed: nothing is guessed from the leaves' shapes."""
    m = small("pqcache")
    st = jax.eval_shape(lambda: engine.init_states(CFG, m, 2, Capacity(64, 8), jnp.float32))[1]
    undeclared = type("Undeclared", (type(m),), {"state_axes": lambda self, s: methods.base.Method.state_axes(self, s)})
    plain = undeclared(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.init})
    assert accounting.slot_bytes(plain, st, 2) == (m.memory_bytes(st) / 2, 0.0)


@pytest.mark.parametrize("name", ["full", "snapkv", "pqcache", "quest", "clusterkv", "chelsea"])
def test_measure_takes_every_statistic_in_one_walk(name):
    """``accounting.measure`` (what a result reports) equals the four statistics taken one by one, on states a
    prefill of two prompts of different lengths filled; ``bytes_read`` is None without ``num_heads``."""
    from kvjax.model import random_params

    m = small(name)
    params = random_params(CFG, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 64), 0, CFG.vocab_size)
    lengths = jnp.asarray([64, 40])
    states = engine.init_states(CFG, m, 2, Capacity(64, 8), jnp.float32)
    states, _ = engine.prefill(CFG, m, params, tokens, lengths, states)
    got = accounting.measure(m, states, CFG.num_heads)
    assert got.tokens_held.tolist() == engine.tokens_held(m, states).tolist()
    assert got.held_bytes.tolist() == engine.held_bytes(m, states).tolist()
    assert got.memory_bytes == engine.memory_bytes(m, states)
    assert got.bytes_read == engine.bytes_read_per_step(m, states, CFG.num_heads)
    assert got.tokens_held[0] > got.tokens_held[1]  # the shorter prompt holds fewer: the states are not empty
    assert accounting.measure(m, states).bytes_read is None
