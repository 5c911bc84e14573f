"""The families researchers use now (Qwen3, Gemma 3, gpt-oss) and YaRN, against transformers (PyTorch) on tiny random
checkpoints built here with ``save_pretrained``: norms, biases and sinks randomised, prompts longer than the
windows, batched with padding. Float32 logits within 1e-4, greedy tokens equal to ``hf.generate``, every registered
method run on every family, and at a budget covering prompt + generated tokens every method gives full's tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import engine, methods
from extended import GROUPS, group
from kvjax.model import forward
from methods_table import small

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 128
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)
YARN5 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
CASES = {
    "qwen3-tied": (
        "Qwen3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
    "qwen3-yarn": (
        "Qwen3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_parameters=YARN5),
    ),
    "qwen3-window": (
        "Qwen3ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=8,
            layer_types=["full_attention", "sliding_attention"],
        ),
    ),
    "llama-yarn": (
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={**YARN5, "beta_fast": 16.0, "truncate": False},
        ),
    ),
    "mistral-yarn": ("MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=YARN5)),
    "qwen2-yarn": (
        "Qwen2ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters={**YARN5, "attention_factor": 1.3}),
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=3.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        ),
    ),
    "gemma3-untied-yarn": (
        "Gemma3ForCausalLM",
        dict(
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=6,
            layer_types=["full_attention", "sliding_attention"],
            tie_word_embeddings=False,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {**YARN5, "rope_theta": 1000000.0},
            },
        ),
    ),
    "mistral-v0.1-window": ("MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8)),
    "qwen2-window": (
        "Qwen2ForCausalLM",
        dict(
            num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1
        ),
    ),
    "gpt-oss": (
        "GptOssForCausalLM",
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            swiglu_limit=0.1,  # small enough that the clamps act on these weights
            rope_parameters={
                "rope_type": "yarn",
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
                "rope_theta": 150000.0,
            },
        ),
    ),
}
#: the cases the engine tests (generate, every method) run on, with the weight scale that makes their greedy
#: continuations input-dependent (not one token repeated)
ENGINE_CASES = {"qwen3-yarn": 3.0, "qwen3-window": 3.0, "gemma3": 3.0, "gpt-oss": 8.0}


def build(arch, options, path, scale=1.0):
    """A random ``arch`` saved to ``path``: 2-D weights times ``scale``, norms, biases and sinks randomised (HF
    initialises them to constants), so that each is checked."""
    torch.manual_seed(0)
    cls = getattr(transformers, arch)
    model = cls(cls.config_class(**{**BASE, **options})).eval()
    gemma = "Gemma" in arch  # (1 + w) norms: w around 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if gemma else 1.0))
            elif name.endswith("bias") or "sinks" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            elif p.ndim >= 2:
                p.mul_(scale)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(case, scale=1.0):
        if (case, scale) not in cache:
            path = tmp_path_factory.mktemp(case.replace("-", "_"))
            hf = build(*CASES[case], path, scale)
            cache[case, scale] = (kvjax.load_model(path, dtype=jnp.float32), hf, path)
        return cache[case, scale]

    return get


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([list(ids)])).logits.numpy()[0]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_batched_with_padding(case, built):
    model, hf, _ = built(case)
    t = 40  # longer than every window of the cases (8) and the YaRN original context (16)
    ids = np.random.RandomState(1).randint(0, VOCAB, size=(2, t))
    lengths = np.array([t, 27])
    out = np.asarray(
        jax.jit(forward, static_argnums=0)(model.config, model.params, jnp.asarray(ids), jnp.asarray(lengths))
    )
    worst = 0.0
    for i, n in enumerate(lengths):
        ref = _hf_logits(hf, ids[i, :n])
        worst = max(worst, float(np.abs(out[i, :n] - ref).max()))
    assert worst < 1e-4, worst


#: and the greedy test also on Mistral v0.1's and Qwen2's windows (every layer, and the layers past
#: max_window_layers), which follow the same rule: ring buffers of the window, prompts longer than it
GREEDY_CASES = {**ENGINE_CASES, "mistral-v0.1-window": 3.0, "qwen2-window": 8.0}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_tokens_equal_transformers(case, built):
    model, hf, _ = built(case, GREEDY_CASES[case])
    rng = np.random.RandomState(2)
    ps = [list(rng.randint(2, VOCAB - 2, size=n)) for n in (23, 11)]
    out = engine.generate(model, ps, "full", max_new_tokens=10, stop_at_eos=False)
    for p, got in zip(ps, out.tokens):
        want = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == want[0, len(p) :].tolist()
    assert len(set(out.tokens[0] + out.tokens[1])) > 3  # not a degenerate repetition


def covering(name: str, total: int):
    """``name`` at its test sizes with a budget covering ``total`` tokens (prompt + generated)."""
    return small(name, **({"budget": total} if methods.takes_budget(name) else {}))


#: YaRN, Qwen3's windows and Gemma 3's QK-norm are the model's (before the cache): every method on them in CI's second
#: line only. The default run covers gpt-oss's local layers and sinks, which the methods handle, with the
#: representative methods (tests/extended.py); the other methods on it in CI's second line.
EXTENDED_CASES = ("qwen3-yarn", "qwen3-window", "gemma3")


def _engine_cases():
    for case in ENGINE_CASES:
        for which in GROUPS:
            ext = case in EXTENDED_CASES or which == "others"
            yield pytest.param(case, which, marks=pytest.mark.extended if ext else (), id=f"{case}-{which}")


@pytest.mark.parametrize("case,which", list(_engine_cases()))
def test_every_method_runs_and_a_covering_budget_gives_full(case, which, built):
    model, _, _ = built(case, ENGINE_CASES[case])
    rng = np.random.RandomState(3)
    ps = [list(rng.randint(2, VOCAB - 2, size=n)) for n in (30, 17)]
    full = engine.generate(model, ps, "full", max_new_tokens=6, driver="scan", stop_at_eos=False)
    failed = {}
    for name in group(which):
        got = engine.generate(model, ps, covering(name, 64), max_new_tokens=6, driver="scan", stop_at_eos=False)
        if got.tokens != full.tokens:
            failed[name] = got.tokens
    assert not failed, (full.tokens, failed)


def test_yarn_spellings_agree():
    """transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``) give one config."""
    common = {**BASE, "model_type": "qwen3", "num_attention_heads": 4, "num_key_value_heads": 2}
    v5 = {**common, "rope_parameters": {**YARN5, "beta_fast": 8.0}}
    v4 = {
        **common,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 8.0, "original_max_position_embeddings": 16},
    }
    a, b = kvjax.ModelConfig.from_hf(v4), kvjax.ModelConfig.from_hf(v5)
    assert a == b and a.rope.rope_type == "yarn" and a.rope.attention_factor == pytest.approx(0.1 * np.log(4) + 1)


def test_unsupported_options_name_themselves():
    common = {**BASE, "num_attention_heads": 4}
    for extra, match in [
        ({"model_type": "qwen3", "rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
        ({"model_type": "qwen3", "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"model_type": "qwen3", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"model_type": "qwen3", "hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "qwen3", "quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"model_type": "phi3"}, "phi3"),
    ]:
        with pytest.raises(ValueError, match=match):
            kvjax.ModelConfig.from_hf({**common, **extra})


# ------------------------------------------------------------------------------------------- hybrid local/global


def test_window_ring_buffer_against_numpy_with_sinks():
    """A local layer's :class:`Window` (prefill, then decode steps that wrap the ring) against a NumPy sliding-window
    attention, with and without learned sinks."""
    from kvjax.methods.base import Capacity
    from kvjax.methods.plans.hybrid import Window
    from kvjax.model.sinks import layer_sinks
    from ref_baselines import attend, attend_sink, window_keep

    cfg = kvjax.ModelConfig("llama", 16, 16, 16, 1, 4, 2, 8, sliding_windows=(6,))
    rng = np.random.RandomState(0)
    b, hq, hkv, d, t, steps, w = 2, 4, 2, 8, 16, 9, 6
    lengths = np.array([13, 4])
    q = rng.randn(b, hq, t + steps, d).astype(np.float32)
    k = rng.randn(b, hkv, t + steps, d).astype(np.float32)
    v = rng.randn(b, hkv, t + steps, d).astype(np.float32)
    method = Window(w)
    for sinks in (None, rng.randn(hq).astype(np.float32)):
        st = method.init(cfg, b, Capacity(t, steps), 0, jnp.float32)
        assert st.k.shape[2] == w  # bounded by the window, whatever the bucket
        st = method.prefill(
            st, 0, jnp.asarray(q[:, :, :t]), jnp.asarray(k[:, :, :t]), jnp.asarray(v[:, :, :t]), jnp.asarray(lengths)
        )
        for step in range(steps):
            pos = lengths + step  # each sequence's next position; its k/v sit at that index of the arrays
            take = lambda x: jnp.asarray(x[np.arange(b), :, pos])  # noqa: E731
            with layer_sinks(None if sinks is None else jnp.asarray(sinks)):
                out, st = method.decode(st, 0, take(q), take(k), take(v), jnp.asarray(pos))
            for i in range(b):
                keep = window_keep(int(pos[i]) + 1, w)
                for h in range(hq):
                    kv = h // (hq // hkv)
                    args = (q[i, h, pos[i]], k[i, kv, keep], v[i, kv, keep])
                    want = attend(*args) if sinks is None else attend_sink(*args, sinks[h])
                    np.testing.assert_allclose(np.asarray(out[i, h]), want, atol=2e-5)
            assert np.asarray(method.tokens_held(st)).tolist() == [min(p + 1, w) for p in pos]


def test_hybrid_plan_holds_the_window_on_local_layers(built):
    """Gemma-3-shaped (two local layers of window 8, one global): the local layers' states are ring buffers of 8
    slots whatever the prompt; the method compresses the global layer only; held bytes, the budget contract and the
    bytes read per step count both kinds; ``layer_plan`` says it; ``compress_local=True`` compresses every layer."""
    from kvjax.methods.base import Capacity
    from kvjax.methods.plans.hybrid import Hybrid, Window, for_model

    model, _, _ = built("gemma3", 3.0)
    cfg = model.config
    rng = np.random.RandomState(5)
    ps = [list(rng.randint(2, VOCAB - 2, size=n)) for n in (40, 21)]
    snap = small("snapkv", budget=12)
    out = engine.generate(model, ps, snap, max_new_tokens=5, driver="scan", stop_at_eos=False)
    plan = for_model(cfg, snap)
    assert isinstance(plan, Hybrid) and plan.at(0) == Window(8) and plan.at(2) == snap
    stat = out.stats[0]
    assert stat["layer_plan"] == "2 local layers: window ring buffers (8 tokens); 1 global layer: snapkv"
    # held: min(n + steps, 8) on each local layer, snapkv's 12 + generated on the global one (mean over layers)
    for s, n in zip(out.stats, (40, 21)):
        assert s["tokens_held"] == pytest.approx((2 * 8 + 12 + 4) / 3)
    cap = Capacity(64, 5)
    want = engine.expected_held_bytes(cfg, snap, cap, jnp.float32, [40, 21], 4, batch=2)
    assert [s["held_bytes"] for s in out.stats] == want.tolist()
    states = engine.init_states(cfg, snap, 2, cap, jnp.float32)
    assert [st.k.shape[2] for st in states[:2]] == [8, 8]  # ring buffers of the window, not the 64-token bucket
    # compressing the local layers too: every layer runs snapkv
    both = engine.generate(model, ps, snap, max_new_tokens=5, driver="scan", stop_at_eos=False, compress_local=True)
    assert both.stats[0]["layer_plan"] == "3 layers: snapkv"
    assert both.stats[0]["tokens_held"] == pytest.approx(12 + 4)
    # full keeps everything on the global layer and the window on the local ones: what the model attends
    full = engine.generate(model, ps, "full", max_new_tokens=5, driver="scan", stop_at_eos=False)
    assert full.stats[0]["tokens_held"] == pytest.approx((2 * 8 + 44) / 3)
    assert full.stats[0]["bytes_read_per_step"] > out.stats[0]["bytes_read_per_step"]


def test_scan_layers_refuses_layers_that_differ(built):
    model, _, path = built("gemma3", 3.0)
    from kvjax.methods.base import Capacity

    with pytest.raises(ValueError, match="scan_layers=False"):
        engine.init_states(model.config, methods.get("full"), 1, Capacity(32, 4), jnp.float32, scan_layers=True)


def test_gemma3_spellings_agree():
    """Gemma 3 in transformers 4.x (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling`` for the global layers,
    ``sliding_window_pattern``) and 5.x (``rope_parameters`` per layer type, ``layer_types``)."""
    common = {
        **BASE,
        "model_type": "gemma3_text",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 6,
        "sliding_window": 8,
        "query_pre_attn_scalar": 16,
    }
    v4 = {
        **common,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "sliding_window_pattern": 6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    v5 = {
        **common,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    }
    a, b = kvjax.ModelConfig.from_hf(v4), kvjax.ModelConfig.from_hf(v5)
    assert a == b and a.sliding_windows == (8,) * 5 + (None,) and a.rope_local.theta == 1e4 and a.rope.factor == 8.0
    assert a.global_layers == (5,)
    for extra, match in [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ]:
        with pytest.raises(ValueError, match=match):
            kvjax.ModelConfig.from_hf({**v5, **extra})


def test_gemma3_text_tower_of_the_multimodal_checkpoint(tmp_path):
    """Gemma3ForConditionalGeneration: kvjax loads its text tower (the vision tower's tensors left out) and gives
    the multimodal model's logits on text. (Its transformers class applies no final soft-cap, so the config has none,
    as Gemma 3's released configs do.)"""
    torch.manual_seed(0)
    text = {**BASE, **CASES["gemma3"][1], "final_logit_softcapping": None}
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    hf = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    ).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and "language_model" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path)
    model = kvjax.load_model(tmp_path, dtype=jnp.float32)
    assert model.config.model_type == "gemma3" and model.config.sliding_windows == (8, 8, None)
    ids = np.random.RandomState(1).randint(3, 100, size=(1, 30))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)).logits.numpy()[0]
    out = np.asarray(forward(model.config, model.params, jnp.asarray(ids)))[0]
    assert np.abs(out - ref).max() < 1e-4


# ------------------------------------------------------------------------------------------------------ gpt-oss


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_attention_with_sinks_against_numpy(window):
    """The prefill attention with learned sinks, dense and in chunks (an online softmax whose sink joins at the
    end), against NumPy: each row's softmax over its causal (windowed) keys and the head's sink logit."""
    from kvjax.model.prefill_attention import chunked_attention, dense_attention, prefill_attention
    from ref_baselines import attend_sink

    rng = np.random.RandomState(0)
    b, hq, hkv, t, d = 2, 4, 2, 24, 8
    q, k, v = (rng.randn(b, h, t, d).astype(np.float32) for h in (hq, hkv, hkv))
    sinks = rng.randn(hq).astype(np.float32)
    lengths = np.array([24, 15])
    args = tuple(jnp.asarray(x) for x in (q, k, v, lengths))
    outs = [
        dense_attention(*args, window, jnp.asarray(sinks)),
        chunked_attention(*args, window, 8, jnp.asarray(sinks)),
        prefill_attention(*args, window, impl=None, sinks=jnp.asarray(sinks)),
    ]
    for i in range(b):
        for h in range(hq):
            for row in range(lengths[i]):
                keys = [s for s in range(row + 1) if window is None or row - s < window]
                want = attend_sink(q[i, h, row], k[i, h // 2, keys], v[i, h // 2, keys], sinks[h])
                for out in outs:
                    np.testing.assert_allclose(np.asarray(out[i, h, row]), want, atol=2e-5)
    with pytest.raises(ValueError, match="sinks"):
        prefill_attention(*args, window, impl="splash", sinks=jnp.asarray(sinks))


def test_gpt_oss_config_spellings_and_refusals():
    common = {
        **BASE,
        "model_type": "gpt_oss",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 4,
        "sliding_window": 128,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    yarn = {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    }
    v5 = {
        **common,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {**yarn, "rope_theta": 150000.0},
    }
    v4 = {**common, "rope_theta": 150000.0, "rope_scaling": yarn}
    a, b = kvjax.ModelConfig.from_hf(v4), kvjax.ModelConfig.from_hf(v5)
    assert a == b and a.sliding_windows == (128, None, 128, None) and a.attention_sinks and a.num_experts == 8
    assert a.global_layers == (1, 3)  # the layers without a window: the ones a method compresses
    assert not a.rope.truncate and a.attention_bias and a.o_bias
    with pytest.raises(ValueError, match="quantization_config.*mxfp4"):
        kvjax.ModelConfig.from_hf({**v5, "quantization_config": {"quant_method": "mxfp4"}})


def test_gpt_oss_every_method_compresses(built):
    """gpt-oss at budgets below the prompt: every method runs with sinks in its softmax (LESS's shared denominator,
    Chelsea's merged slots included) and keeps what its budget says on the global layers."""
    model, _, _ = built("gpt-oss", ENGINE_CASES["gpt-oss"])
    rng = np.random.RandomState(4)
    ps = [list(rng.randint(2, VOCAB - 2, size=n)) for n in (40, 26)]
    for name in ("streaming_llm", "snapkv", "chelsea", "less"):
        out = engine.generate(model, ps, small(name, budget=12), max_new_tokens=4, driver="scan")
        assert all(len(t) == 4 for t in out.tokens), name
        assert out.stats[0]["layer_plan"].startswith("2 local layers: window ring buffers (8 tokens)")


@pytest.mark.parametrize(
    "arch,options",  # Gemma 3 by default (a hybrid layer plan); Qwen3 and gpt-oss in CI's second line
    [
        pytest.param("Qwen3ForCausalLM", dict(head_dim=16), marks=pytest.mark.extended),
        ("Gemma3ForCausalLM", dict(head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
        pytest.param(
            "GptOssForCausalLM",
            dict(head_dim=16, sliding_window=4, num_local_experts=4, num_experts_per_tok=2),
            marks=pytest.mark.extended,
        ),
    ],
)
def test_kvjax_generate_runs_on_each_family(arch, options, tmp_path, capsys):
    from tiny_models import save_tiny

    from kvjax import cli

    folder = save_tiny(tmp_path / "tiny", arch, **options)
    argv = ["generate", "--model", str(folder), "--method", "snapkv", "--budget", "8", "--max-new-tokens", "3"]
    assert cli.main([*argv, "--prompt", "the cat sat on the mat and looked at the dog for a while"]) == 0
    err = capsys.readouterr().err
    if arch != "Qwen3ForCausalLM":
        assert "1 local layer: window ring buffers (4 tokens); 1 global layer: snapkv" in err


#: transformers' module names -> llama.cpp's tensor names (``blk.N.<name>.weight``)
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GGUF_NORMS = {
    "qwen3": {"post_attention_layernorm": "ffn_norm"},
    "gemma3": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}


def _write_gguf(hf, path, arch):
    """A GGUF file of ``hf`` with llama.cpp's ``arch`` names and metadata and float32 tensors, as
    ``convert_hf_to_gguf.py`` writes them: no q/k row permutation for these NeoX-RoPE architectures, Gemma's norms
    stored as ``1 + w``, a SentencePiece-style token list for Gemma (transformers' GGUF reader wants one)."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if arch == "gemma3":
        w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
        w.add_sliding_window(c.sliding_window)
        w.add_tokenizer_model("llama")
        w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
        w.add_token_scores([0.0] * c.vocab_size)
        w.add_token_types([1] * c.vocab_size)
    else:
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    names = {**GGUF_NAMES, **GGUF_NORMS[arch]}
    for name, p in hf.state_dict().items():
        x = p.numpy().astype(np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            x = x + 1.0
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", x)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", x)
        elif name == "lm_head.weight":
            if not c.tie_word_embeddings:  # a tied head is the embedding (llama.cpp then writes no output)
                w.add_tensor("output.weight", x)
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:-1])
            w.add_tensor(f"blk.{layer}.{names[rest]}.weight", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3_gguf_matches_transformers(built, tmp_path):
    pytest.importorskip("gguf")
    _, hf, _ = built("qwen3-tied")
    _write_gguf(hf, tmp_path / "qwen3.gguf", "qwen3")
    model = kvjax.load_model(tmp_path / "qwen3.gguf", dtype=jnp.float32, tokenizer=False)
    assert model.config.model_type == "qwen3" and model.config.qk_norm and model.config.tie_word_embeddings
    ids = np.random.RandomState(1).randint(0, VOCAB, size=(1, 30))
    out = np.asarray(forward(model.config, model.params, jnp.asarray(ids)))[0]
    assert np.abs(out - _hf_logits(hf, ids[0])).max() < 1e-4


def test_gemma3_gguf_matches_transformers(tmp_path):
    """A Gemma 3 GGUF (llama.cpp's names and conventions: norms stored as 1 + w, five local layers to one global,
    a local RoPE base of 10000, scores scaled by 1/sqrt(head_dim)) read by kvjax gives the model's logits; the same
    file read by transformers' GGUF loader gives them too, so the file follows the conventions both read."""
    pytest.importorskip("gguf")
    options = dict(
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=256, sliding_window=8,
        query_pre_attn_scalar=256,
    )  # fmt: skip
    hf = build("Gemma3ForCausalLM", options, tmp_path / "hf")
    _write_gguf(hf, tmp_path / "g3.gguf", "gemma3")
    model = kvjax.load_model(tmp_path / "g3.gguf", dtype=jnp.float32, tokenizer=False)
    assert model.config.sliding_windows == (8,) * 5 + (None,) and model.config.rope_local.theta == 10000.0
    ids = np.random.RandomState(1).randint(3, 100, size=(1, 30))
    ref = _hf_logits(hf, ids[0])
    out = np.asarray(forward(model.config, model.params, jnp.asarray(ids)))[0]
    assert np.abs(out - ref).max() < 1e-4
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="g3.gguf", dtype=torch.float32)
    assert np.abs(_hf_logits(theirs.eval(), ids[0]) - ref).max() < 1e-4


def test_fidelity_probes_a_hybrid_model_as_the_engine_runs_it(built):
    """eval's fidelity probe on a hybrid model: the local layers run (and are referenced by) their ring buffers, so
    their error is 0 whatever the method; the global layer's is the method's."""
    from eval import fidelity

    model, _, _ = built("gemma3", 3.0)
    ids = list(np.random.RandomState(0).randint(2, VOCAB - 2, size=40))
    full = fidelity.probe(model, ids, methods.get("full"), probes=4)
    snap = fidelity.probe(model, ids, small("snapkv", budget=12), probes=4)
    assert full["rel_error"] == [0.0, 0.0, 0.0]
    assert snap["rel_error"][:2] == [0.0, 0.0] and snap["rel_error"][2] > 0
    assert snap["tokens_held"] == pytest.approx((8 + 8 + 12) / 3)


def test_hybrid_plan_is_bucket_independent_and_compiles_once(built):
    """The same prompts in two buckets keep the same tokens and generate the same output on a hybrid model (the
    ring buffers' contents follow each prompt's own length); a second batch of the same shapes compiles nothing."""
    model, _, _ = built("gemma3", 3.0)
    rng = np.random.RandomState(6)
    ps = [list(rng.randint(2, VOCAB - 2, size=n)) for n in (37, 12)]
    snap = small("snapkv", budget=10)
    a = engine.generate(model, ps, snap, max_new_tokens=5, driver="scan", stop_at_eos=False, prompt_len=64)
    b = engine.generate(model, ps, snap, max_new_tokens=5, driver="scan", stop_at_eos=False, prompt_len=128)
    assert a.tokens == b.tokens
    assert [s["tokens_held"] for s in a.stats] == [s["tokens_held"] for s in b.stats]
    before = dict(engine.TRACE_COUNTS)
    other = [list(rng.randint(2, VOCAB - 2, size=n)) for n in (50, 9)]
    engine.generate(model, other, snap, max_new_tokens=5, driver="scan", stop_at_eos=False, prompt_len=64)
    assert dict(engine.TRACE_COUNTS) == before
