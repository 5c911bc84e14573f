"""The families researchers use now (Qwen3, Gemma 3, gpt-oss) and YaRN, against transformers (PyTorch) on tiny random
checkpoints built here with ``save_pretrained``: norms, biases and sinks randomised, prompts longer than the
windows, batched with padding. Float32 logits within 1e-4, greedy tokens equal to ``hf.generate``, every registered
method run on every family, and at a budget covering prompt + generated tokens every method gives full's tokens."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import engine, methods
from kvjax.model import forward

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
        dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters={**YARN5, "beta_fast": 16.0, "truncate": False}),
    ),
    "mistral-yarn": ("MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=YARN5)),
    "qwen2-yarn": (
        "Qwen2ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters={**YARN5, "attention_factor": 1.3}),
    ),
}
#: the case each family's engine tests (generate, every method) run on
ENGINE_CASES = ["qwen3-yarn", "qwen3-window"]


def build(arch, options, path, scale=1.0):
    """A random ``arch`` saved to ``path``: 2-D weights times ``scale``, norms, biases and sinks randomised (HF
    initialises them to constants), so that each is checked."""
    torch.manual_seed(0)
    cls = getattr(transformers, arch)
    model = cls(cls.config_class(**BASE, **options)).eval()
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
    out = np.asarray(jax.jit(forward, static_argnums=0)(model.config, model.params, jnp.asarray(ids), jnp.asarray(lengths)))
    worst = 0.0
    for i, n in enumerate(lengths):
        ref = _hf_logits(hf, ids[i, :n])
        worst = max(worst, float(np.abs(out[i, :n] - ref).max()))
    assert worst < 1e-4, worst


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_greedy_tokens_equal_transformers(case, built):
    model, hf, _ = built(case, 3.0)
    rng = np.random.RandomState(2)
    ps = [list(rng.randint(2, VOCAB - 2, size=n)) for n in (23, 11)]
    out = engine.generate(model, ps, "full", max_new_tokens=10, stop_at_eos=False)
    for p, got in zip(ps, out.tokens):
        want = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == want[0, len(p) :].tolist()
    assert len(set(out.tokens[0] + out.tokens[1])) > 3  # not a degenerate repetition


def covering(name: str, total: int):
    """``name`` at its test sizes with a budget covering ``total`` tokens (prompt + generated)."""
    return methods.small(name, **({"budget": total} if methods.takes_budget(name) else {}))


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_every_method_runs_and_a_covering_budget_gives_full(case, built):
    model, _, _ = built(case, 3.0)
    rng = np.random.RandomState(3)
    ps = [list(rng.randint(2, VOCAB - 2, size=n)) for n in (30, 17)]
    full = engine.generate(model, ps, "full", max_new_tokens=6, driver="scan", stop_at_eos=False)
    failed = {}
    for name in methods.names():
        got = engine.generate(model, ps, covering(name, 64), max_new_tokens=6, driver="scan", stop_at_eos=False)
        if got.tokens != full.tokens:
            failed[name] = got.tokens
    assert not failed, (full.tokens, failed)


def test_yarn_spellings_agree():
    """transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``) give one config."""
    common = {**BASE, "model_type": "qwen3", "num_attention_heads": 4, "num_key_value_heads": 2}
    v5 = {**common, "rope_parameters": {**YARN5, "beta_fast": 8.0}}
    v4 = {**common, "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 8.0,
                                                             "original_max_position_embeddings": 16}}
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
