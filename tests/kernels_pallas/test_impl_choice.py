"""``impl=None`` takes a platform kernel only where it has been verified (kernels_pallas/impl_choice.py), checked on
CPU by faking the backend ``impl_choice.backend`` reports: unverified -> the XLA path and one warning naming the
kernel and the variable; the variable, ``KVJAX_UNVERIFIED_KERNELS=1``, a record, or an explicit ``impl=`` -> the
kernel. The record is updated from a junit file as ``scripts/accelerator.sh tests`` does."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas.accumulated_attention as aa
import kernels_pallas.chunked_similarity as cs
import kernels_pallas.cosine_kmeans as ck
import kernels_pallas.decode_attention as da
import kernels_pallas.pq_lookup as pq
from kernels_pallas import impl_choice as IC
from kvjax.model import prefill_attention as P

#: kernel -> (its default_impl, the XLA path's name)
KERNELS = {
    "decode_attention": (da.default_impl, "xla"),
    "pq_lookup": (pq.default_impl, "xla"),
    "cosine_kmeans": (ck.default_impl, "xla"),
    "chunked_similarity": (cs.default_impl, "xla"),
    "accumulated_attention": (aa.default_impl, "xla"),
    "prefill_attention": (P.default_impl, "chunked"),
}
PLATFORM = {
    "gpu": {
        "decode_attention": "pallas_gpu",
        "pq_lookup": "pallas_gpu",
        "cosine_kmeans": "pallas_gpu",
        "chunked_similarity": "pallas_gpu",
        "accumulated_attention": "pallas_gpu",
        "prefill_attention": "cudnn",
    },
    "tpu": {
        "decode_attention": "pallas_tpu",
        "pq_lookup": "pallas_tpu",
        "cosine_kmeans": "pallas_tpu",
        "chunked_similarity": "pallas_tpu",
        "accumulated_attention": None,  # no TPU kernel: the XLA path, no warning
        "prefill_attention": "splash",
    },
}


@pytest.fixture
def fake(monkeypatch):
    """``fake(backend, record=None)``: impl_choice sees that backend and record; no variable set, no warning yet."""
    monkeypatch.setattr(IC, "_warned", set())
    for var in (*IC.ENV_VARS.values(), IC.ALL_ENV):
        monkeypatch.delenv(var, raising=False)

    def set_(backend, record=None, slower=None):
        monkeypatch.setattr(IC, "backend", lambda: backend)
        monkeypatch.setattr(IC, "SLOWER_THAN_XLA", slower or {})
        monkeypatch.setattr(IC, "load_verified", lambda: record or {k: {"gpu": None, "tpu": None} for k in KERNELS})

    return set_


def test_the_shipped_record_and_its_documentation():
    record = IC.load_verified()
    assert set(record) == set(IC.PLATFORM_IMPLS) == set(IC.ENV_VARS) == set(IC.VERIFYING_TESTS) == set(KERNELS)
    assert (da.ENV_IMPL, P.ENV_IMPL, pq.ENV_IMPL, ck.ENV_IMPL, cs.ENV_IMPL, aa.ENV_IMPL) == tuple(
        IC.ENV_VARS[k]
        for k in (
            "decode_attention",
            "prefill_attention",
            "pq_lookup",
            "cosine_kmeans",
            "chunked_similarity",
            "accumulated_attention",
        )
    )
    fields = {"impl", "device_kind", "jax", "date", "tests"}
    for kernel, by in record.items():
        assert set(by) == {"gpu", "tpu"}
        for backend, entry in by.items():
            assert entry is None or (set(entry) == fields and entry["impl"] == PLATFORM[backend][kernel])
    doc = (Path(__file__).resolve().parents[2] / "docs" / "accelerator.md").read_text()
    for kernel, by in record.items():  # docs/accelerator.md's table (a row per kernel) says what the record says
        row = next(line for line in doc.splitlines() if line.startswith("|") and f"`{IC.ENV_VARS[kernel]}`" in line)
        gpu, tpu = row.split("|")[3:5]
        for backend, cell in (("gpu", gpu), ("tpu", tpu)):
            if PLATFORM[backend][kernel] is None:
                assert "no TPU kernel" in cell and by[backend] is None, (kernel, backend, cell)
                continue
            assert f"`{PLATFORM[backend][kernel]}`" in cell
            assert ("not verified" in cell) == (by[backend] is None), (kernel, backend, cell)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_unverified_kernels_take_the_xla_path_and_say_so_once(fake, caplog, monkeypatch, backend):
    fake(backend)
    with caplog.at_level(logging.WARNING, logger="kvjax.kernels"):
        for name, (default, xla) in KERNELS.items():
            assert default() == xla and default() == xla, name
    has = {name: by for name, by in KERNELS.items() if PLATFORM[backend][name]}  # kernels with one here
    assert len(caplog.records) == len(has)  # once per kernel, not per call; none where there is no kernel
    for rec, name in zip(caplog.records, has):
        msg = rec.getMessage()
        assert name in msg and PLATFORM[backend][name] in msg and f"{IC.ENV_VARS[name]}=" in msg, msg
    # the kernel's variable, or the one for all, forces the platform kernel
    for name, (default, _) in has.items():
        monkeypatch.setenv(IC.ENV_VARS[name], PLATFORM[backend][name])
        assert default() == PLATFORM[backend][name]
        monkeypatch.delenv(IC.ENV_VARS[name])
    monkeypatch.setenv(IC.ALL_ENV, "1")
    assert all(default() == PLATFORM[backend][name] for name, (default, _) in has.items())
    assert all(default() == xla for name, (default, xla) in KERNELS.items() if name not in has)


def test_a_verified_kernel_is_taken_on_its_backend_only(fake):
    entry = {
        "impl": "pallas_gpu",
        "device_kind": "NVIDIA H100",
        "jax": jax.__version__,
        "date": "2026-11-25",
        "tests": "40/40 passed",
    }
    record = {k: {"gpu": None, "tpu": None} for k in KERNELS}
    record["decode_attention"]["gpu"] = entry
    record["pq_lookup"]["gpu"] = {**entry, "impl": "pallas_tpu"}  # a record of another implementation: not this
    fake("gpu", record)
    assert (da.default_impl(), pq.default_impl(), P.default_impl()) == ("pallas_gpu", "xla", "chunked")
    fake("tpu", record)
    assert da.default_impl() == "xla"
    fake("cpu", record)
    assert all(default() == xla for default, xla in KERNELS.values())


def test_a_kernel_measured_slower_than_xla_is_not_the_default(fake, monkeypatch):
    """Verified but recorded slower than the XLA path on that backend: impl=None takes xla there, without a warning
    and also under KVJAX_UNVERIFIED_KERNELS=1; its own variable still takes it; other backends are unaffected."""
    entry = {"impl": "pallas_gpu", "device_kind": "NVIDIA H200", "jax": "0.11.2", "date": "2026-11-26", "tests": "4/4"}
    record = {k: {"gpu": None, "tpu": None} for k in KERNELS}
    record["cosine_kmeans"]["gpu"] = record["decode_attention"]["gpu"] = entry
    fake("gpu", record, {"cosine_kmeans": {"gpu": "measured"}})
    assert (ck.default_impl(), da.default_impl()) == ("xla", "pallas_gpu")
    monkeypatch.setenv(IC.ALL_ENV, "1")
    assert ck.default_impl() == "xla"
    monkeypatch.setenv(ck.ENV_IMPL, "pallas_gpu")
    assert ck.default_impl() == "pallas_gpu"
    monkeypatch.delenv(ck.ENV_IMPL)
    fake("tpu", record, {"cosine_kmeans": {"gpu": "measured"}})
    assert ck.default_impl() == "pallas_tpu"  # KVJAX_UNVERIFIED_KERNELS=1 still set
    assert "slower than the XLA path" in IC.table()


def test_explicit_impl_still_forces_the_kernel(fake, monkeypatch):
    import kernels_pallas.chunked_similarity.pallas_gpu as gpu

    fake("gpu")
    called = []
    monkeypatch.setattr(gpu, "chunk_best_match_gpu", lambda *a, **kw: called.append(kw) or "kernel")
    k = jnp.asarray(np.random.default_rng(0).normal(size=(1, 1, 4, 8)), jnp.float32)
    valid = jnp.ones((1, 1, 4), bool)
    assert cs.chunk_best_match(k, valid, 4, impl="pallas_gpu") == "kernel"
    best, idx = cs.chunk_best_match(k, valid, 4)  # impl=None on an unverified GPU: the reference
    ref_best, ref_idx = cs.chunk_best_match_reference(k, valid, 4)
    np.testing.assert_array_equal(best, ref_best)
    np.testing.assert_array_equal(idx, ref_idx)
    monkeypatch.setenv(cs.ENV_IMPL, "pallas_gpu")
    assert cs.chunk_best_match(k, valid, 4) == "kernel" and len(called) == 2


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.accelerator.test_kernels" name="test_decode_attention_cases[a]" time="1"/>
<testcase classname="tests.accelerator.test_kernels" name="test_decode_attention_bf16" time="1"/>
<testcase classname="tests.accelerator.test_kernels" name="test_pq_lookup_cases[x]" time="1"/>
<testcase classname="tests.accelerator.test_kernels" name="test_pq_lookup_lengths[y]" time="1">
  <failure message="mismatch">assert</failure></testcase>
<testcase classname="tests.accelerator.test_prefill" name="test_platform_impl_matches_chunked[smollm2-None]">
  <skipped message="no cudnn"/></testcase>
<testcase classname="tests.accelerator.test_methods" name="test_method_with_kernels_matches_reference[full]"/>
</testsuite></testsuites>"""


def test_record_from_junit(tmp_path):
    path = tmp_path / "verified.py"
    shutil.copy(IC.VERIFIED_FILE, path)
    (tmp_path / "run.xml").write_text(JUNIT)
    before = IC._read(path)
    before["cosine_kmeans"]["gpu"] = {
        "impl": "pallas_gpu",
        "device_kind": "old",
        "jax": "0",
        "date": "x",
        "tests": "1/1 passed",
    }
    path.write_text(path.read_text().split("VERIFIED = ")[0] + "VERIFIED = " + repr(before) + "\n")
    IC.record_from_junit(tmp_path / "run.xml", path, device_kind="NVIDIA H100 80GB HBM3", on="gpu")
    after = IC._read(path)
    assert after["decode_attention"]["gpu"] == {
        "impl": "pallas_gpu",
        "device_kind": "NVIDIA H100 80GB HBM3",
        "jax": jax.__version__,
        "date": after["decode_attention"]["gpu"]["date"],
        "tests": "2/2 passed",
    }
    assert after["pq_lookup"]["gpu"] is None  # a failure: not verified
    assert after["prefill_attention"]["gpu"] is None  # skipped: not verified
    assert after["cosine_kmeans"]["gpu"] == before["cosine_kmeans"]["gpu"]  # did not run: unchanged
    assert all(v["tpu"] is None for v in after.values())
    assert path.read_text().startswith('"""Which platform kernels')  # the docstring kept
    with pytest.raises(ValueError, match="only a GPU or TPU run verifies"):
        IC.record_from_junit(tmp_path / "run.xml", path, on="cpu")
    assert "not verified (XLA path)" in IC.table()
    assert "`pallas_gpu`: verified 20" in IC.table(after) and "on NVIDIA H100 80GB HBM3" in IC.table(after)


def test_a_kernel_without_a_tpu_kernel_is_recorded_on_gpu_only(tmp_path):
    """``accumulated_attention`` has a GPU kernel only: its passing tests record it on a GPU; on a TPU (where they
    skip) the record is left as it was and nothing fails for the missing platform kernel."""
    path = tmp_path / "verified.py"
    shutil.copy(IC.VERIFIED_FILE, path)
    case = '<testcase classname="tests.accelerator.test_kernels" name="test_accumulated_attention_cases[f32-gqa2]"/>'
    (tmp_path / "run.xml").write_text(f'<testsuites><testsuite name="pytest">{case}</testsuite></testsuites>')
    after = IC.record_from_junit(tmp_path / "run.xml", path, device_kind="NVIDIA H100", on="gpu")
    assert after["accumulated_attention"]["gpu"]["impl"] == "pallas_gpu"
    assert after["accumulated_attention"]["gpu"]["tests"] == "1/1 passed"
    after = IC.record_from_junit(tmp_path / "run.xml", path, device_kind="TPU v5e", on="tpu")
    assert after["accumulated_attention"]["tpu"] is None
    assert "no kernel (XLA path)" in IC.table(after)
