"""Which methods generate what ``full`` does at ``budget=1.0``, as docs/interface.md's budget section says.

Each registered method at its small sizes (``methods_table.small``: windows, pages and clusters of a few tokens, so its
decode-time mechanics run on a 48-token prompt) generates greedily on a tiny random Llama (tests/tiny_models.py)
beside ``full``. The budget contract predicts the outcome: a method equals ``full`` when it holds ``n + s``
tokens at every step ``s`` and, for a recall method, attends all of them (``attended(n, s) >= n + s + 1``, the new
token included). The evicting methods (``streaming_llm``, ``h2o``, ``less``) keep evicting to ``ceil(1.0 n) = n``
while decoding, and the recall methods attend a prompt-sized budget out of ``n + s`` held tokens."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import kvjax
from kvjax import engine, methods
from kvjax.methods.base import Capacity, LayerContext
from extended import GROUPS, cases, group
from tiny_models import save_tiny_llama
from methods_table import small_at_budget

pytest.importorskip("transformers")
DOC = Path(__file__).resolve().parents[2] / "docs" / "interface.md"
NEW = 16
LENGTHS = (48, 31)
WHAT = ("Equal to", "Not equal to")


def documented() -> tuple[set[str], set[str]]:
    """The method names of the two budget-1.0 paragraphs of docs/interface.md: (equal to full, not equal)."""
    text = DOC.read_text()
    found = [re.search(rf"^\*\*{what} `full` at `budget=1.0`\*\*:(.*?)\n\n", text, re.M | re.S) for what in WHAT]
    assert all(found), "docs/interface.md should hold the two budget=1.0 paragraphs"
    same, differ = (set(re.findall(r"`([a-z0-9_]+)`", m.group(1))) & set(methods.REGISTRY) for m in found)
    return same | {"full"}, differ


def predicted_equal(method, num_layers: int) -> bool:
    """The budget contract's answer: every layer holds ``n + s`` and, if it recalls, attends every held token."""
    for n in LENGTHS:
        for layer in range(num_layers):
            ctx = LayerContext(layer, num_layers, Capacity(64, NEW))
            m = method.at(layer)
            for s in range(NEW):
                if m.held(n, s, ctx) != n + s or (m.recalls and m.attended(n, s, ctx) < n + s + 1):
                    return False
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``run(names)``: each method of ``names`` and ``full`` at budget 1.0 -> ``(model, {name: (method, tokens)})``."""
    model = kvjax.load_model(save_tiny_llama(tmp_path_factory.mktemp("whole-budget")), dtype="float32")
    rng = np.random.RandomState(0)
    prompts = [[int(t) for t in rng.randint(3, 2000, size=n)] for n in LENGTHS]

    def run(names):
        out = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # small windows: budget warnings
            for name in dict.fromkeys(("full", *names)):  # full: the reference, once
                m = small_at_budget(name, 1.0)
                out[name] = (m, engine.generate(model, prompts, m, max_new_tokens=NEW, stop_at_eos=False).tokens)
        return model, out

    return run


# the representative methods by default (tests/extended.py), the others in CI's second line
@pytest.mark.parametrize("which", cases(GROUPS, {"representatives"}))
def test_which_methods_equal_full_at_the_whole_budget(runs, which):
    model, out = runs(group(which))
    full = out["full"][1]
    equal = {name for name, (_, tokens) in out.items() if tokens == full}
    assert equal == {name for name, (m, _) in out.items() if predicted_equal(m, model.config.num_layers)}
    same, differ = (set(out) & group for group in documented())
    assert (same, differ) == (equal, set(out) - equal), "docs/interface.md's budget=1.0 lines disagree with the runs"
