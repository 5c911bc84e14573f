"""What a new user meets first: the modules the docs call ``kvjax.engine.questions`` and ``kvjax.engine.prefilled``
after a plain ``import kvjax``; the bytes a generation holds along the way (``generate(..., track_held=True)``);
a method that computes exactly full attention at the size asked for says so once
(``kvjax.budget.FullAttentionWarning``); an instruct model's questions use its chat template by default, and raw
text that ends at once warns (``kvjax.engine.ChatTemplateWarning``)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import budget, engine, methods
from kvjax.engine import questions
from kvjax.loading import Model
from kvjax.methods import Capacity
from kvjax.loading.tokenizer import Tokenizer
from tiny_models import tiny_config


def test_import_kvjax_exposes_questions_and_prefilled():
    code = "import kvjax; print(kvjax.engine.questions.answer.__name__, kvjax.engine.prefilled.prefill_once.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["answer", "prefill_once"]


def _cfg(num_layers=2, vocab=64):
    return tiny_config(num_layers=num_layers, vocab_size=vocab)


class _CharTokenizer(Tokenizer):
    """Characters as ids (2 + code % 60); decodes to nothing when ``silent`` (an instruct model ending at once)."""

    def __init__(self, chat_template, silent=False):
        super().__init__(
            vocab_size=64, bos_token_id=None, eos_token_ids=[1], pad_token_id=0, chat_template=chat_template
        )
        self.silent = silent

    def encode(self, text, add_special_tokens=False):
        return [2 + ord(c) % 60 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "" if self.silent else "".join(chr(97 + i % 26) for i in ids)

    def _render(self, messages, add_generation_prompt):
        return "<user>" + messages[-1]["content"] + "<assistant>"


# the sizes and seed of the tiny fixture's model (tests/conftest.py)
pytestmark = pytest.mark.tiny(seed=3)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(budget, "_warned", set())


def _ids(n, seed=0):
    return [int(x) for x in np.random.RandomState(seed).randint(2, 60, size=n)]


# ---- held bytes along the generation ----


@pytest.mark.parametrize(
    "name, options, bounded",
    [("full", {}, False), ("h2o", {"budget": 12}, True), ("snapkv", {"budget": 0.5, "window": 4}, False)],
)
def test_held_bytes_per_step_is_what_the_contract_says_at_every_step(tiny, name, options, bounded):
    method = methods.get(name, **options)
    prompts, new = [_ids(30, 1), _ids(21, 2)], 12
    res = engine.generate(tiny, prompts, method, max_new_tokens=new, driver="scan", track_held=True)
    plain = engine.generate(tiny, prompts, method, max_new_tokens=new, driver="scan")
    assert res.tokens == plain.tokens, "tracking the held bytes changed the tokens"
    cap = Capacity(engine.bucket_length(30), new)
    for i, (st, n) in enumerate(zip(res.stats, (30, 21))):
        trace = st["held_bytes_per_step"]
        assert len(trace) == st["decode_steps"] == new
        assert trace[-1] == st["held_bytes"] == plain.stats[i]["held_bytes"]
        want = [int(engine.expected_held_bytes(tiny.config, method, cap, tiny.dtype, [n], s)[0]) for s in range(new)]
        assert trace == want, f"{name}: held bytes per step {trace}, the budget contract {want}"
        steps = np.diff(trace)
        if bounded:
            assert (steps == 0).all(), f"{name} evicts each step: held bytes should stay flat, {trace}"
        else:
            assert (steps > 0).all(), f"{name} appends each step: held bytes should grow, {trace}"


def test_held_bytes_per_step_stops_where_the_while_driver_stops(tiny):
    res = engine.generate(tiny, [_ids(9, 4)], "full", max_new_tokens=6, track_held=True)
    assert len(res.stats[0]["held_bytes_per_step"]) == res.stats[0]["decode_steps"]
    assert "held_bytes_per_step" not in engine.generate(tiny, [_ids(9, 4)], "full", max_new_tokens=6).stats[0]


# ---- a method that computes exactly full attention at this size ----

EXAMPLE = dict(prompt_len=32, max_new_tokens=4)  # docs/pure-functions.md's sizes


@pytest.mark.parametrize(
    "name, options",
    [("pqcache", {}), ("chelsea", {"budget": 0.5}), ("quest", {"n_full": 0}), ("clusterkv", {"n_full": 0})],
)
def test_full_attention_at_the_example_size_warns_once(fresh_warnings, name, options):
    cfg, m = _cfg(1), methods.get(name, **options)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(2):
            jax.eval_shape(lambda: m.at(0).init(cfg, 2, Capacity(**EXAMPLE), 0, jnp.float32))
    msgs = [str(w.message) for w in got if issubclass(w.category, budget.FullAttentionWarning)]
    assert len(msgs) == 1, msgs
    assert f"{name}: this configuration computes exactly full attention" in msgs[0]
    assert "32-token prompt and 4 new tokens" in msgs[0]


@pytest.mark.parametrize(
    "name, options, capacity",
    [
        ("snapkv", {"budget": 0.5}, EXAMPLE),
        ("pqcache", {}, dict(prompt_len=512, max_new_tokens=4)),  # past sink + 2^bits: PQ retrieval
        ("chelsea", {"budget": 0.5}, dict(prompt_len=512, max_new_tokens=64)),  # merge rounds
        ("quest", {"n_full": 0, "budget": 0.25}, EXAMPLE),
        ("clusterkv", {"n_full": 0, "budget": 16}, EXAMPLE),
        ("chelsea", {"budget": 1.0}, EXAMPLE),  # the whole prompt, asked for
    ],
)
def test_a_method_that_compresses_does_not_warn(fresh_warnings, name, options, capacity):
    cfg, m = _cfg(1), methods.get(name, **options)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        jax.eval_shape(lambda: m.at(0).init(cfg, 2, Capacity(**capacity), 0, jnp.float32))
    assert not [w for w in got if issubclass(w.category, budget.FullAttentionWarning)]


def test_generate_warns_when_every_layer_is_a_full_first_layer(tiny, fresh_warnings):
    match = r"quest: .* its 2 layers.*full first layers \(n_full or full_layers\)"
    with pytest.warns(budget.FullAttentionWarning, match=match):
        engine.generate(tiny, [_ids(40)], methods.get("quest", budget=0.5), max_new_tokens=2)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        engine.generate(tiny, [_ids(40)], methods.get("quest", budget=0.5, n_full=1), max_new_tokens=2)
    assert not [w for w in got if issubclass(w.category, budget.FullAttentionWarning)]


# ---- chat templates ----


def _chat_model(tiny, silent):
    return Model(tiny.config, tiny.params, _CharTokenizer("{{ messages }}", silent=silent), "tiny-instruct")


def test_questions_follow_the_model_chat_template_by_default(tiny):
    model = _chat_model(tiny, silent=False)
    ctx = questions.compress_context(model, "some context", methods.get("full"), max_new_tokens=40)
    q = "Where?"
    templated = len(model.tokenizer.encode_chat([{"role": "user", "content": q}]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", engine.ChatTemplateWarning)
        res = questions.answer(model, ctx, [q], max_new_tokens=3)
    assert res.stats[0]["question_tokens"] == templated
    raw = questions.answer(model, ctx, [q], max_new_tokens=3, chat=False)
    assert raw.stats[0]["question_tokens"] == len(q)


def test_raw_text_to_an_instruct_model_that_answers_nothing_warns(tiny):
    model = _chat_model(tiny, silent=True)
    ctx = questions.compress_context(model, "some context", methods.get("full"), max_new_tokens=40)
    with pytest.warns(engine.ChatTemplateWarning, match=r"2 of 2 outputs are empty.*pass chat=True"):
        questions.answer(model, ctx, ["Where?", "Who?"], max_new_tokens=3, chat=False)
    with pytest.warns(engine.ChatTemplateWarning, match=r"1 of 1 outputs are empty"):
        engine.generate(model, "Where?", "full", max_new_tokens=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", engine.ChatTemplateWarning)
        engine.generate(model, "Where?", "full", max_new_tokens=3, chat=True)  # the template: no warning
        engine.generate(model, [_ids(5)], "full", max_new_tokens=3)  # token ids: the caller's choice


def test_the_decode_budget_split_the_docs_state():
    """docs/usage.md and ``methods.get``: PyramidKV splits ``decode_budget`` over the layers (30 layers at
    ``D=4096``: 7980 at layer 0 down to 237 at the top, mean ``D``), so a 200-token prompt generating 320 tokens
    re-compresses its top layers; SnapKV's ``D`` is per layer and such a generation never reaches it."""
    import re
    from pathlib import Path

    pyramid = methods.get("pyramidkv", budget=0.2, decode_budget=4096)
    shares = [pyramid.target(layer, 30) for layer in range(30)]
    assert (shares[0], shares[-1]) == (7980, 237) and abs(np.mean(shares) - 4096) < 30, shares
    assert shares[-1] < 200 + 320 < 4096
    snap = methods.get("snapkv", budget=0.2, decode_budget=4096)
    assert {snap.target(layer, 30) for layer in range(30)} == {4096}
    root = Path(__file__).resolve().parents[2]
    usage = " ".join((root / "docs" / "usage.md").read_text().split())
    assert re.search(r"7,980 at layer 0 down to 237 at the top", usage)
    assert "7980 at layer 0 down to 237" in " ".join(methods.get.__doc__.split())
