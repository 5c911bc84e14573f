"""One prefill of the model compressed by many methods (``kvjax.engine.prefilled``): for every registered method, the
states and logits of ``compress(prefill_once(...))`` equal ``engine.prefill``'s (the per-method path, which the
oracle tests check), unrolled and scanned, and ``generate(..., prefilled=)`` gives the same tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import engine, methods
from kvjax.engine import prefilled as P
from kvjax import model as M
from kvjax.loading import Model
from kvjax.methods.base import Capacity
from methods_table import small


# the sizes and seed of the tiny fixture's model (tests/conftest.py)
pytestmark = pytest.mark.tiny(num_layers=3, max_position_embeddings=256, seed=3)


def _method(name):
    return small(name, **({} if name == "full" else {"budget": 0.3}))


def _batch():
    rng = np.random.default_rng(0)
    ids = [[int(x) for x in rng.integers(1, 64, n)] for n in (23, 64, 41)]
    return ids, *engine.pad_prompts(ids, 64)


#: scanned, by default: a method of each prefill kind (attends the prompt itself: h2o; reuses the previous layer's
#: selection: chunkkv) and a recall method (clusterkv's full first layer: a single layer beside a stacked segment);
#: every other method with --runslow. Unrolled: the two prefill kinds.
KINDS = methods.cover("attends_prompt", "reuses_previous_layer", any_true=True)
FAST = KINDS + methods.cover("n_full", any_true=True)


@pytest.mark.parametrize(
    "scan,names",
    [
        (True, FAST),
        pytest.param(True, tuple(n for n in methods.names() if n not in FAST), marks=pytest.mark.slow),
        (False, KINDS),
    ],
)
@pytest.mark.filterwarnings("ignore::kvjax.budget.BudgetWarning")
def test_compressing_one_prefill_gives_each_methods_own_prefill(tiny, scan, names):
    ids, tokens, lengths = _batch()
    params = M.stack_layers(tiny.params) if scan else tiny.params
    model = Model(tiny.config, params, None, "tiny")
    pre = P.prefill_once(model, tokens, lengths)
    assert pre.q.shape == (3, 3, 4, 64, 16) and pre.k.shape == (3, 3, 2, 64, 16)
    assert P.nbytes(tiny.config, 3, 64, jnp.float32) == pre.q.nbytes + pre.k.nbytes + pre.v.nbytes
    for name in names:
        m = _method(name)
        init = lambda: engine.init_states(tiny.config, m, 3, Capacity(64, 4), jnp.float32, scan_layers=scan)
        want, logits = engine.prefill(tiny.config, m, params, jnp.asarray(tokens), jnp.asarray(lengths), init())
        got = P.compress(tiny.config, m, pre, init())
        np.testing.assert_allclose(pre.logits, logits, rtol=1e-5, atol=1e-5, err_msg=name)
        assert jax.tree.structure(got) == jax.tree.structure(want), name
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            a, b = np.asarray(a), np.asarray(b)
            if np.issubdtype(b.dtype, np.floating):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
            else:
                np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.filterwarnings("ignore::kvjax.budget.BudgetWarning")
def test_generate_with_a_prefilled_batch(tiny):
    ids, tokens, lengths = _batch()
    pre = P.prefill_once(tiny, tokens, lengths)
    for name in ("snapkv",):
        m = _method(name)
        a = kvjax.generate(tiny, ids, m, 5, driver="scan", prompt_len=64, stop_at_eos=False)
        b = kvjax.generate(tiny, ids, m, 5, driver="scan", prompt_len=64, stop_at_eos=False, prefilled=pre)
        assert a.tokens == b.tokens, name
        assert [s["held_bytes"] for s in a.stats] == [s["held_bytes"] for s in b.stats], name
    with pytest.raises(ValueError, match="prefilled= is the prefill of another batch"):
        kvjax.generate(tiny, ids[:2], "snapkv", 3, prompt_len=64, prefilled=pre)
