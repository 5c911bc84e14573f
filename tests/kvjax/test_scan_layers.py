"""Scan over layers (``kvjax.load_model(..., scan_layers=True)``, ``engine.init_states(..., scan_layers=True)``).

The reference is the unrolled engine (itself checked against ``transformers`` logits in test_parity.py): for
every registered method, the scanned layer stack gives the same logits (fp32, 1e-5) at prefill and at every
decode step, the same per-layer states (tokens held, bytes held, bytes read), and the same greedy tokens through
``generate``, whose decode loop compiles once. Also: the layer plan (which layers form a scanned run), the
stacked parameter layout, sharded scanning on a mesh, and the errors.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

import kvjax
from kvjax import engine, methods, model as M, sharding
from kvjax.config import ModelConfig
from kvjax.loading import Model
from kvjax.methods.base import Capacity
from kvjax.methods.full import Full
from methods_table import small_at_budget
from tiny_models import tiny_config

BUCKET, STEPS = 64, 4


def method(name, budget=0.3, **extra):
    """``name`` at its small options (``methods_table.small``: every method compresses at these lengths, as in the
    budget-contract tests), then ``extra``."""
    return small_at_budget(name, budget, **extra)


SIZES = dict(vocab_size=256, intermediate_size=128, num_layers=4, max_position_embeddings=512)
TINY = tiny_config(**SIZES)
# the tiny fixture's model (tests/conftest.py): TINY, with weights of std 0.15
pytestmark = pytest.mark.tiny(**SIZES, scale=0.15)


def scans(m, cfg=TINY, cap=Capacity(BUCKET, STEPS + 1)) -> bool:
    """Whether some run of ``m``'s layer plan on ``cfg`` holds more than one layer (a scanned stack): not where the
    states differ per layer (PyramidKV's slot count per layer, at the tiny model's sizes)."""
    return any(len(r) > 1 for r in engine.scan_runs(cfg, m, 3, cap, jnp.float32))


def slow(name: str) -> bool:
    """The default run checks the methods whose scanned body differs most (index reuse under lax.cond, merged slots,
    stacked learned kernels) and the simple ones; the recall methods (slow to compile) and the methods whose layers
    stay unrolled at the tiny model's sizes with --runslow."""
    return methods.REGISTRY[name].recalls or not scans(method(name))


#: the simple slot caches of H2O's kind: their scanned body is H2O's, checked by default; in CI's second line
EXTENDED = ("streaming_llm", "snapkv")


def marks(name: str):
    return pytest.mark.slow if slow(name) else pytest.mark.extended if name in EXTENDED else ()


def prompts():
    rng = np.random.RandomState(0)
    return [list(rng.randint(1, 255, size=n)) for n in (45, 17, 60)]


def run(model: Model, m, scan: bool, mesh=None):
    """Prefill + STEPS greedy steps through the public jitted functions: (logits [STEPS+1, B, V], states)."""
    cfg = model.config
    params = M.stack_layers(model.params) if scan else model.params
    if mesh is not None:
        params = sharding.shard_params(cfg, params, mesh)
    tokens, lengths = engine.pad_prompts(prompts(), BUCKET)
    states = engine.init_states(cfg, m, len(lengths), Capacity(BUCKET, STEPS + 1), model.dtype, mesh, scan_layers=scan)
    tokens, lengths = sharding.put_batch(jnp.asarray(tokens), mesh), sharding.put_batch(jnp.asarray(lengths), mesh)
    states, logits = engine.prefill(cfg, m, params, tokens, lengths, states, mesh=mesh)
    out, pos = [np.asarray(logits)], lengths
    for _ in range(STEPS):
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits, states = engine.decode_step(cfg, m, params, states, tok, pos, mesh=mesh)
        out.append(np.asarray(logits))
        pos = pos + 1
    return np.stack(out), states


@pytest.mark.parametrize(
    "name,extra",
    [pytest.param(n, {}, marks=marks(n)) for n in methods.names()]
    + [pytest.param("chunkkv", {"reuse": 2}, id="chunkkv-reuse2")],  # index reuse in the body: a cond on the layer
)
def test_scan_matches_unrolled(tiny, name, extra):
    m = method(name, **extra)
    ref, ref_states = run(tiny, m, scan=False)
    got, states = run(tiny, m, scan=True)
    # a stack wherever the plan has a run of layers (not PyramidKV's slot count per layer: test_layer_plan)
    assert any(isinstance(s, engine.Stacked) for s in states) == scans(m), states
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))
    per = engine.layer_states(states)
    assert len(per) == tiny.config.num_layers
    np.testing.assert_array_equal(engine.tokens_held(m, states), engine.tokens_held(m, ref_states))
    assert engine.memory_bytes(m, states) == engine.memory_bytes(m, ref_states)
    assert engine.bytes_read_per_step(m, states, 4) == engine.bytes_read_per_step(m, ref_states, 4)
    for a, b in zip(per, ref_states):  # every leaf of every layer's state, bit for bit up to float tolerance
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-5, atol=1e-5)


def test_scan_falls_back_to_slices_when_the_views_fail(tiny, monkeypatch):
    """Where the in-place evaluator cannot run a program (say a jax version whose jaxpr it does not know), the
    scanned layer runs on its slice with ``jax.core.eval_jaxpr`` and writes it back: same logits, one warning."""
    from kvjax.engine import inplace

    def broken(*a, **k):
        raise NotImplementedError("unknown primitive")

    m = method("snapkv")
    ref, _ = run(tiny, m, scan=False)
    monkeypatch.setattr(inplace, "_eval", broken)
    monkeypatch.setattr(inplace, "_WARNED", [])
    jax.clear_caches()
    with pytest.warns(RuntimeWarning, match="slice-and-write-back"):
        got, _ = run(tiny, m, scan=True)
    jax.clear_caches()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_scan_operand_counts_in_both_jax_forms():
    """The in-place evaluator splits a ``scan`` equation's operands into consts, carry and xs: jax 0.10 names the
    counts (``num_consts``, ``num_carry``), jax 0.11 packs the groups in a tree (``ft_in``). Both forms, and the
    equation this jax makes, give (consts, carry)."""
    from kvjax.engine import inplace

    class Groups:  # jax 0.11's FlatTree: unpack() gives the (consts, carry, xs) groups
        def unpack(self):
            return ([0, 1], [2], [3, 4, 5])

    assert inplace._scan_split({"num_consts": 2, "num_carry": 1}) == (2, 1)
    assert inplace._scan_split({"ft_in": Groups()}) == (2, 1)
    w, v = jnp.ones(3), jnp.ones(4)

    def f(c, xs):
        return jax.lax.scan(lambda c, x: (c * w[0] + v[1] + x, x), c, xs)

    (eqn,) = [e for e in jax.make_jaxpr(f)(1.0, jnp.ones(5)).jaxpr.eqns if e.primitive.name == "scan"]
    assert inplace._scan_split(eqn.params) == (2, 1)


def test_layer_plan(tiny):
    cfg, cap = tiny.config, Capacity(BUCKET, 8)
    plan = lambda m: [(r.start, r.stop) for r in engine.scan_runs(cfg, m, 2, cap, jnp.float32)]
    assert plan(method("snapkv")) == [(0, 4)]
    assert plan(method("clusterkv")) == [(0, 1), (1, 4)]  # n_full=1: a full layer, then three clustered ones
    assert plan(method("quest", n_full=2)) == [(0, 2), (2, 4)]  # two full layers agree with each other
    assert plan(method("chelsea", outlier_heads=((2, 1),))) == [(0, 2), (2, 3), (3, 4)]  # layer 2 has outliers
    pyramid = plan(method("pyramidkv"))  # one slot count per layer: runs only where neighbours agree
    slots = [method("pyramidkv").prompt_slots(BUCKET, l, 4) for l in range(4)]
    want, start = [], 0
    for l in range(1, 5):
        if l == 4 or slots[l] != slots[start]:
            want.append((start, l))
            start = l
    assert pyramid == want


def test_stacked_params_roundtrip(tiny):
    stacked = M.stack_layers(tiny.params)
    assert M.is_stacked(stacked) and not M.is_stacked(tiny.params)
    assert stacked["layers"]["wq"].shape == (4, 64, 64)
    back = M.unstack_layers(stacked)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tiny.params)):
        np.testing.assert_array_equal(a, b)
    tokens = jnp.asarray([prompts()[0]], jnp.int32)  # the dense forward reads either layout
    np.testing.assert_allclose(
        M.forward(tiny.config, stacked, tokens), M.forward(tiny.config, tiny.params, tokens), rtol=1e-6, atol=1e-6
    )


def test_generate_from_scanned_checkpoint_compiles_once(tmp_path):
    """A local HF folder loaded with scan_layers=True: same tokens as the unrolled model, one compile of the
    decode loop for two calls of one bucket."""
    hf = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    import torch

    torch.manual_seed(0)
    LlamaForCausalLM(hf).save_pretrained(tmp_path)
    plain = kvjax.load_model(tmp_path, dtype="float32")
    scanned = kvjax.load_model(tmp_path, dtype="float32", scan_layers=True)
    assert M.is_stacked(scanned.params)
    m = method("h2o", budget=0.4)
    want = engine.generate(plain, prompts(), m, 6, stop_at_eos=False)
    before = engine.TRACE_COUNTS["loop_while"]
    got = engine.generate(scanned, prompts(), m, 6, stop_at_eos=False)
    again = engine.generate(scanned, prompts()[::-1], m, 6, stop_at_eos=False)
    assert got.tokens == want.tokens
    assert again.tokens == want.tokens[::-1]
    assert engine.TRACE_COUNTS["loop_while"] - before == 1
    assert [s["tokens_held"] for s in got.stats] == [s["tokens_held"] for s in want.stats]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py sets them)")
@pytest.mark.parametrize("name", [pytest.param("snapkv", marks=pytest.mark.slow), "chelsea"])
def test_scan_on_a_mesh(name):
    """Scanned layers on data=2 x model=4 (8 KV heads split): the same logits as one device unrolled."""
    cfg = ModelConfig("llama", 256, 64, 128, 3, 8, 8, 16, max_position_embeddings=512)
    model = Model(cfg, M.random_params(cfg, jax.random.PRNGKey(2), scale=0.15), None, "tiny8")
    mesh = sharding.make_mesh("data=1,model=8")
    m = method(name)
    ref, _ = run(model, m, scan=False)
    got, states = run(model, m, scan=True, mesh=mesh)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    stack = next(s for s in states if isinstance(s, engine.Stacked))
    spec = stack.state.k.sharding.spec
    assert spec[0] is None and spec[2] == "model", spec  # the layer axis whole, KV heads split


def test_errors(tiny):
    @dataclasses.dataclass(frozen=True)
    class Mine(Full):
        traced_layer = False

    with pytest.raises(ValueError, match="traced_layer"):
        engine.init_states(tiny.config, Mine(), 1, Capacity(BUCKET, 4), jnp.float32, scan_layers=True)
    windows = dataclasses.replace(tiny.config, sliding_windows=(None, None, 16, 16))  # Qwen2's per-layer windows
    with pytest.raises(ValueError, match="differ in window.*scan_layers=False"):  # before anything is allocated
        engine.init_states(windows, Full(), 3, Capacity(BUCKET, 4), jnp.float32, scan_layers=True)


def _computing_ops(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(op, dims) of every instruction of a compiled program that computes or copies a value (parameters, tuples,
    bitcasts, loops and tuple elements only alias their operands)."""
    out = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* (\S+?)\(", line)
        if m and m.group(2) not in ("parameter", "get-tuple-element", "tuple", "bitcast", "while"):
            out.append((m.group(2), tuple(int(x) for x in m.group(1).split(",") if x)))
    return out


@pytest.mark.parametrize("name", [pytest.param(n, marks=marks(n)) for n in methods.names()])
def test_scanned_loop_updates_the_stack_in_place(name):
    """The compiled decode loop of a scanned layer stack writes each layer's new token into the stacked cache in place,
    as the unrolled loop writes its per-layer buffers (test_engine.py::test_loop_updates_cache_in_place): no copy of
    the stacked K/V or per-slot leaves ``[L, B, Hkv, S, ...]``, and no K/V slice ``[B, Hkv, S, D]`` of a layer computed
    or copied, per layer and step (the decode attention reads ``chunk < S`` rows at a time straight from the stack).
    Shapes at which the attention's chunk (256 rows) is shorter than every cache; nothing is allocated (abstract
    states). Every layer
    runs the method (a method's own full first layers, ``n_full``, are set to none: an unstacked full layer writes
    a ``[B, Hkv, S, D]`` buffer in place, which this test cannot tell from a slice). A method that re-compresses the
    whole cache on some steps (``recompresses``: Chelsea's merge round) computes values of a layer's K/V shape
    there; no copy still holds."""
    cfg = ModelConfig("llama", 256, 64, 128, 4, 16, 8, 128, max_position_embeddings=4096)
    m = method(name, budget=0.6)
    if "n_full" in {f.name for f in dataclasses.fields(m)}:
        m = dataclasses.replace(m, n_full=0)
    cap, b = Capacity(512, 37), 2
    assert scans(m, cfg, cap), "this method's layers do not stack at these sizes; choose others"
    states = jax.eval_shape(lambda: engine.init_states(cfg, m, b, cap, jnp.float32, scan_layers=True))
    assert [type(s) for s in states] == [engine.Stacked], states
    params = jax.eval_shape(lambda: M.stack_layers(M.random_params(cfg, jax.random.PRNGKey(0))))
    loop = engine.DecodeLoop(cfg, m, kvjax.engine.sampling.Greedy(), cap.max_new_tokens, (95,))
    ints = jax.ShapeDtypeStruct((b,), jnp.int32)
    hlo = engine.run_loop.lower(loop, "while", params, states, ints, ints, jax.random.PRNGKey(0)).compile().as_text()
    ops = _computing_ops(hlo)
    leaves = jax.tree.leaves(states[0].state)
    slots = max(x.shape[3] for x in leaves if x.ndim == 5)
    kv = {x.shape[1:] for x in leaves if x.ndim == 5 and x.shape[3] == slots}  # K, V: [L, B, Hkv, S, D], most slots
    assert len(kv) == 1 and slots > 256, kv
    stacks = {x.shape for x in leaves if x.ndim >= 4 and x.shape[3] == slots}  # K, V and per-slot [L, B, Hkv, S]
    copied = [(op, sh) for op, sh in ops if op == "copy" and sh in stacks]
    assert copied == [], copied
    if not m.recompresses:
        sliced = [(op, sh) for op, sh in ops if sh in kv]
        assert sliced == [], sliced
