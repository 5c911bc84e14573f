"""Engine tests: the full method against transformers and against the dense forward pass, drivers, batching,
compression methods at budget >= prompt, no retracing, in-place cache updates, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import engine, methods
from kvjax.methods.base import Capacity
from tiny_models import random_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random GQA Llama saved with save_pretrained, loaded by kvjax and by transformers."""
    hf = random_hf(  # weights x3: peaked, input-dependent logits (no EOS-like collapse)
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=95,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(path)
    return kvjax.load_model(path, dtype=jnp.float32), hf


def prompts(n, lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(2, 90, size=l)) for l in lengths[:n]]


def test_full_matches_transformers_generate(tiny):
    model, hf = tiny
    for p in prompts(3, [7, 19, 12]):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        out = engine.generate(model, [p], "full", max_new_tokens=12, stop_at_eos=False)
        assert out.tokens[0] == ref


def test_decode_logits_equal_forward(tiny):
    model, _ = tiny
    cfg, params = model.config, model.params
    p = prompts(1, [11])[0]
    cap = Capacity(16, 8)
    method = methods.get("full")
    states = engine.init_states(cfg, method, 1, cap, jnp.float32)
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, :11] = p
    states, logits = engine.prefill(cfg, method, params, jnp.asarray(tokens), jnp.asarray([11]), states)
    seq = list(p)
    for step in range(6):
        ref = kvjax.model.forward(cfg, params, jnp.asarray([seq]))[0, -1]
        np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(ref), atol=1e-4, rtol=1e-4)
        nxt = int(jnp.argmax(logits[0]))
        seq.append(nxt)
        logits, states = engine.decode_step(
            cfg, method, params, states, jnp.asarray([nxt]), jnp.asarray([len(seq) - 1])
        )


def test_drivers_agree_and_batch_equals_single(tiny):
    model, _ = tiny
    ps = prompts(3, [5, 23, 14], seed=1)
    outs = {
        d: engine.generate(model, ps, "full", max_new_tokens=10, driver=d).tokens for d in ("scan", "while", "python")
    }
    assert outs["scan"] == outs["while"] == outs["python"]
    singles = [engine.generate(model, [p], "full", max_new_tokens=10, prompt_len=32).tokens[0] for p in ps]
    assert outs["while"] == singles


def test_eos_stops_while_loop(tiny):
    model, _ = tiny
    p = prompts(1, [9], seed=2)[0]
    free = engine.generate(model, [p], "full", max_new_tokens=8, stop_at_eos=False).tokens[0]
    # Declare the 3rd generated token an EOS: generation must stop before it and the loop must end early.
    model2 = kvjax.Model(
        kvjax.ModelConfig(**{**model.config.__dict__, "eos_token_ids": (free[2],)}), model.params, None, "tiny-eos"
    )
    out = engine.generate(model2, [p], "full", max_new_tokens=8)
    cut = free.index(free[2])
    assert out.tokens[0] == free[:cut]
    assert out.stats[0]["decode_steps"] == cut + 1


@pytest.mark.parametrize(
    "name,options",
    [
        # Evicting methods (streaming_llm, h2o) hold `budget` tokens in all, generated ones included.
        ("streaming_llm", {"budget": 64}),
        ("h2o", {"budget": 36}),
        ("snapkv", {"budget": 1.0}),
        ("pyramidkv", {"budget": 1.0}),
        ("snapkv", {"budget": 64}),
        ("pyramidkv", {"budget": 30}),
    ],
)
def test_budget_covering_prompt_equals_full(tiny, name, options):
    model, _ = tiny
    ps = prompts(2, [17, 30], seed=3)
    full = engine.generate(model, ps, "full", max_new_tokens=6, driver="scan").tokens
    got = engine.generate(model, ps, methods.get(name, **options), max_new_tokens=6, driver="scan").tokens
    assert got == full


def test_a_one_token_budget_does_not_stand_in_for_the_whole_prompt(tiny):
    """``budget=1`` (one token) then ``budget=1.0`` (the whole prompt) in one process: the second holds and
    generates what ``full`` does. Before ``Method.__eq__`` compared field types, the two methods were equal, and
    ``generate`` ran the one-token program compiled first for both (the same order in another test file made
    test_budget_covering_prompt_equals_full fail under pytest-xdist)."""
    model, _ = tiny
    ps = prompts(2, [17, 30], seed=3)
    full = engine.generate(model, ps, "full", max_new_tokens=6, driver="scan")
    one = engine.generate(model, ps, methods.get("pyramidkv", budget=1), max_new_tokens=6, driver="scan")
    whole = engine.generate(model, ps, methods.get("pyramidkv", budget=1.0), max_new_tokens=6, driver="scan")
    assert [s["tokens_held_prefill"] for s in one.stats] == [1.0, 1.0]
    assert [s["tokens_held_prefill"] for s in whole.stats] == [17.0, 30.0] and whole.tokens == full.tokens


def test_compiles_once_per_bucket(tiny):
    model, _ = tiny
    method = methods.get("snapkv", budget=0.5)
    engine.generate(model, prompts(1, [20], seed=4), method, max_new_tokens=5)
    before = dict(engine.TRACE_COUNTS)
    engine.generate(model, prompts(1, [27], seed=5), method, max_new_tokens=5)  # same bucket (32)
    assert dict(engine.TRACE_COUNTS) == before
    engine.generate(model, prompts(1, [40], seed=5), method, max_new_tokens=5)  # next bucket (64)
    assert engine.TRACE_COUNTS["prefill"] == before["prefill"] + 1


def test_own_loop_shares_generates_compiled_programs(tiny):
    """``engine.prefill`` / ``decode_step`` called without ``mesh`` (a user's loop), with ``mesh=None`` (what
    ``generate`` passes) or with it positional share one compiled program each (jit keys on how arguments are
    passed: each compiled twice before), and the loop gives ``generate``'s tokens."""
    model, _ = tiny
    cfg, method = model.config, methods.get("snapkv", budget=0.5)
    ids = prompts(2, [21, 9], seed=6)
    tokens, lengths = (jnp.asarray(a) for a in engine.pad_prompts(ids, 32))
    before = dict(engine.TRACE_COUNTS)
    states = engine.init_states(cfg, method, 2, Capacity(32, 4), jnp.float32)
    states, logits = engine.prefill(cfg, method, model.params, tokens, lengths, states)
    out, pos = [], lengths
    for _ in range(3):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out.append(np.asarray(token))
        logits, states = engine.decode_step(cfg, method, model.params, states, token, pos)
        pos = pos + 1
    out.append(np.asarray(jnp.argmax(logits, axis=-1)))
    traced = {k: engine.TRACE_COUNTS[k] - before.get(k, 0) for k in ("prefill", "decode_step")}
    assert traced == {"prefill": 1, "decode_step": 1}
    res = engine.generate(model, ids, method, max_new_tokens=4, driver="python", stop_at_eos=False, prompt_len=32)
    states = engine.init_states(cfg, method, 2, Capacity(32, 4), jnp.float32)
    engine.prefill(cfg, method, model.params, tokens, lengths, states, None)  # mesh positional
    assert {k: engine.TRACE_COUNTS[k] - before.get(k, 0) for k in ("prefill", "decode_step")} == traced
    assert res.tokens == np.stack(out, axis=1).tolist()


def test_loop_updates_cache_in_place(tiny):
    """The compiled while body must not copy a whole per-layer cache buffer (docs/architecture.md#one-decode-loop)."""
    model, _ = tiny
    cfg = model.config
    cap = Capacity(32, 16)
    method = methods.get("full")
    states = engine.init_states(cfg, method, 2, cap, jnp.float32)
    loop = engine.DecodeLoop(cfg, method, kvjax.engine.sampling.Greedy(), 16, (95,))
    args = (model.params, states, jnp.zeros((2,), jnp.int32), jnp.asarray([5, 9]), jax.random.PRNGKey(0))
    hlo = engine.run_loop.lower(loop, "while", *args).compile().as_text()
    cache_shape = "f32[2,2,48,16]"
    copies = [l for l in hlo.splitlines() if " copy(" in l and cache_shape in l.split("=")[1].split("copy(")[0]]
    assert hlo.count(cache_shape) > 0
    assert copies == [], copies[:3]


def test_bad_input(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="prompt_len"):
        engine.generate(model, prompts(1, [40]), "full", max_new_tokens=4, prompt_len=32)
    with pytest.raises(ValueError, match="model context"):
        engine.generate(model, prompts(1, [40]), "full", max_new_tokens=250)
    with pytest.raises(ValueError, match="driver"):
        engine.generate(model, prompts(1, [4]), "full", max_new_tokens=4, driver="loop")
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(model, prompts(1, [4]), "full", max_new_tokens=0)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate(model, ["text"], "full", max_new_tokens=4)
    with pytest.raises(ValueError, match="not registered"):
        engine.generate(model, prompts(1, [4]), "nope", max_new_tokens=4)


def test_held_bytes_follow_each_sequence(tiny):
    """``stats["held_bytes"]`` is what each sequence holds at the end, by hand: full holds ``n + steps - 1`` slots
    per KV head and layer (the last sampled token is never fed back), each K and V (D float32) plus its int32 position,
    plus two int32 counters per layer; H2O holds its budget; the allocated ``cache_bytes`` is the same for every
    sequence of the batch."""
    model, _ = tiny
    cfg = model.config
    lengths, steps = [9, 23], 6
    per_slot = cfg.num_kv_heads * (2 * cfg.head_dim * 4 + 4)
    out = engine.generate(model, prompts(2, lengths), "full", max_new_tokens=steps, stop_at_eos=False)
    for n, st in zip(lengths, out.stats):
        assert st["tokens_held"] == n + steps - 1
        assert st["held_bytes"] == cfg.num_layers * ((n + steps - 1) * per_slot + 2 * 4)
    assert out.stats[0]["cache_bytes"] == out.stats[1]["cache_bytes"] > out.stats[1]["held_bytes"]
    h2o = methods.get("h2o", budget=8)
    out = engine.generate(model, prompts(2, lengths), h2o, max_new_tokens=steps, stop_at_eos=False)
    per_slot_h2o = per_slot + cfg.num_kv_heads * 4  # + the float32 accumulated score
    for st in out.stats:
        assert st["tokens_held"] == 8 and st["held_bytes"] == cfg.num_layers * (8 * per_slot_h2o + 2 * 4)
