"""Every registered method on the embedded SmolLM2-135M on the device against the same method on CPU
(``smollm2_cpu.json``, written by ``tests/accelerator/embedded.py --write``; the run is described there).

On the device (``JAX_PLATFORMS=cuda python3 -m pytest tests/accelerator -m accelerator``), each method runs with
its default kernels (Pallas decode attention and the method's own kernels) in float32 at ``HIGHEST`` matmul
precision, fed the CPU run's tokens. Tolerances: the CPU's top-``TOP`` logits within ``atol`` absolute, and at every
step and sequence whose CPU top-1/top-2 margin is at least ``2 atol`` (and ``MARGIN``) the greedy token is the CPU's
(below it the arithmetic does not decide the token: summation order differs between backends). ``atol`` is
``ATOL``, or ``SPREAD_X`` times the method's rounding spread where that is larger: how far weights perturbed by 8
float32 ulps move the same CPU run (``embedded.spread``, in the golden file). Near-ties in a method's own selection
(Chelsea's merge edges) make that spread 0.07 where ``full``'s is 1e-4: such a method changes what it keeps under
any change of arithmetic, so no device can be held closer to the CPU than that. A failure names the method, the
step and the deviation; the deviation is also recorded as the test's ``deviation`` property in the junit XML, and,
with ``KVJAX_ACCELERATOR_OUT=DIR``, in ``DIR/embedded_<method>.json`` as soon as the method has run.

On CPU (no marker), a change detector (the golden file is the CPU run's own output, so this checks that it did not
change, not that it is right): the CPU run gives the same tokens and logits within 1e-3 or twice the method's
rounding spread (by default for three methods; ``--runslow``: every method), and every method holds under half the
tokens of ``full`` or reads less per decode step (so the device comparison is one of compressed runs).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import embedded  # noqa: E402

from kvjax import methods  # noqa: E402

MARGIN, ATOL, SPREAD_X = 0.05, 2e-2, 2.0
DEFAULT_CPU = methods.cover("recalls", any_true=True)  # PQCache; every method with --runslow
#: CI's second line (tests/extended.py): full's outputs are checked against transformers, Chelsea's against NumPy
EXTENDED_CPU = ("full", *methods.cover("recompresses", any_true=True))


def _golden_marks(name: str):
    return () if name in DEFAULT_CPU else pytest.mark.extended if name in EXTENDED_CPU else pytest.mark.slow


@pytest.fixture(scope="module")
def golden():
    try:
        embedded.model()
    except (FileNotFoundError, ImportError) as e:  # the asset wheel or the gguf package is not installed
        pytest.skip(f"the embedded model cannot be loaded here: {e}")
    return json.loads(embedded.GOLDEN.read_text())


def compare(name, got, want, margin, atol):
    want_ids = np.asarray(want["top_ids"])
    at = np.take_along_axis(got["logits"], want_ids, -1)
    np.testing.assert_allclose(
        at, np.asarray(want["top_logits"]), atol=atol, rtol=0, err_msg=f"{name}: top logits differ from the CPU run"
    )
    decided = np.asarray(want["margin"]) >= margin
    same = np.asarray(got["tokens"]) == np.asarray(want["tokens"])
    bad = np.argwhere(decided & ~same)
    assert not len(bad), f"{name}: greedy token differs from the CPU run at (step, sequence) {bad.tolist()}"


def test_golden_covers_every_method(golden):
    assert set(golden["methods"]) == set(methods.names()), "regenerate: python3 tests/accelerator/embedded.py --write"
    full = golden["methods"]["full"]
    for name, r in golden["methods"].items():  # each method compresses: holds fewer tokens or reads less
        assert (
            not methods.takes_budget(name)
            or r["bytes_read"] < full["bytes_read"]
            or max(np.asarray(r["held"]) / np.asarray(full["held"])) < 0.5
        ), name
        assert len(set(np.ravel(r["tokens"]).tolist())) > 5, name  # the tokens depend on the input


@pytest.mark.parametrize("name", [pytest.param(n, marks=_golden_marks(n)) for n in methods.names()])
def test_cpu_run_unchanged_since_the_golden_was_written(golden, name):
    """A change detector, not a check of correctness: the golden file is this CPU run's own output, so this fails
    when a change moves the CPU tokens or logits (then regenerate with ``embedded.py --write`` if the change is
    meant), and says nothing about whether they are right. Logits within 1e-3, or twice the method's rounding spread
    where that is larger: another CPU's vector units are a change of arithmetic too (on a Xeon @ 2.8 GHz with
    AVX-512, 2026-11-27, Chelsea's top logits moved 0.043 from the golden file's, PQCache's 0.0014, their spreads
    being 0.070 and 0.0013; every other method's stayed within 1e-3)."""
    want = golden["methods"][name]
    got = embedded.run(name, feed=want["tokens"][: embedded.STEPS])
    compare(name, got, want, margin=0.0, atol=max(1e-3, SPREAD_X * want["rounding_spread"]))


@pytest.mark.accelerator
@pytest.mark.parametrize("name", methods.names())
def test_device_matches_cpu(golden, name, record_property):
    want = golden["methods"][name]
    got = embedded.run(name, feed=want["tokens"][: embedded.STEPS])
    atol = tolerance(want)
    dev = round(embedded.deviation(got, want), 5)
    record_property("deviation", dev)
    record_property("atol", atol)
    out = os.environ.get("KVJAX_ACCELERATOR_OUT")  # a step's time limit can stop pytest before its summary
    if out:
        tokens = np.asarray(got["tokens"]) != np.asarray(want["tokens"])
        Path(out, f"embedded_{name}.json").write_text(
            json.dumps({"method": name, "deviation": dev, "atol": atol, "tokens_differing": tokens.sum().item()})
        )
    compare(name, got, want, max(MARGIN, 2 * atol), atol)


def tolerance(want) -> float:
    """The device test's ``atol`` for one method's golden entry (module docstring)."""
    return max(ATOL, SPREAD_X * want["rounding_spread"])


def test_tolerance_is_the_arithmetics_except_where_the_rounding_spread_says():
    """The golden file's spreads: the methods without near-ties in their selection keep ``ATOL``; a spread that
    loosens a method's tolerance is one the CPU run itself shows, not one this test chose."""
    g = json.loads(embedded.GOLDEN.read_text())["methods"]
    assert all("rounding_spread" in r for r in g.values()), "regenerate: embedded.py --write --spread-only"
    assert tolerance(g["full"]) == ATOL and g["full"]["rounding_spread"] < 1e-3
