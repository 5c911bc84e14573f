"""The decode-attention tuning table (``kernels_pallas.decode_attention.tuning``) and the sweep that fills it
(``benchmarks/decode_attention.py --sweep``): every candidate computes the reference's partials (interpret mode),
the kernels read the table, and the sweep picks the candidate with the lowest total time."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.decode_attention import decode_attention_reference, pallas_gpu, tuning

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_attention as bench  # noqa: E402


def test_table_rows_are_candidates_and_valid():
    for impl, row in tuning.TABLE.items():
        assert row.measured, impl  # every row says where its values come from
        assert dataclasses.replace(row, measured="") in tuning.CANDIDATES[impl], impl
    with pytest.raises(ValueError, match="impl='cuda'"):
        tuning.get("cuda")


@pytest.mark.parametrize(
    "b,hkv,n,target,want",
    [(1, 8, 256, 264, (32, 8)), (8, 8, 256, 264, (4, 64)), (1, 8, 256, 528, (64, 4)), (2, 3, 7, 264, (7, 1))],
)
def test_num_splits_reaches_the_target(b, hkv, n, target, want):
    # splits * per covers the n entries, per a power of two, about max(1, target // (b * hkv)) splits
    assert pallas_gpu.num_splits(b, hkv, n, target) == want
    splits, per = want
    assert splits * per >= n and per & (per - 1) == 0


def test_num_splits_reads_the_table(monkeypatch):
    monkeypatch.setitem(
        tuning.TABLE, "pallas_gpu", dataclasses.replace(tuning.TABLE["pallas_gpu"], target_programs=528)
    )
    assert pallas_gpu.num_splits(1, 8, 256) == (64, 4)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_every_candidate_matches_the_reference(impl):
    """Every block size (and split target) a sweep may choose, with the sweep's re-expressed block list."""
    seen = {}
    for c in tuning.CANDIDATES[impl]:  # warps and stages do not change interpret-mode results
        seen.setdefault((c.block_size, c.target_programs), c)
    q, k, v, bi, _, _ = bench._inputs(2, 2, 2, 1024, 32, jnp.float32, 0.5, 128)
    want = decode_attention_reference(q, k, v, block_indices=bi, block_size=128)
    for c in seen.values():
        fn = bench.kernel_with(impl, c, interpret=True)
        b = bench.in_blocks_of(bi, c.block_size)
        got = fn(q, k, v, b)
        if c.block_size > 128:  # a bigger block also holds unlisted 128-slot blocks: compare with those listed
            want_c = decode_attention_reference(q, k, v, block_indices=b, block_size=c.block_size)
        else:
            want_c = want
        for x, y in zip(got, want_c):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-4, err_msg=str(c))


def test_sweep_writes_the_chosen_row(tmp_path, monkeypatch):
    """The chosen candidate has the lowest total time; the JSON is written after every candidate (a run cut by its time
    limit keeps what was timed), ``partial`` until the end."""
    out = tmp_path / "sweep.json"
    written = []
    real = bench._write
    monkeypatch.setattr(bench, "_write", lambda *a, **kw: (real(*a, **kw), written.append(json.loads(out.read_text()))))
    bench.main(
        [
            "--sweep",
            "--impl",
            "pallas_gpu",
            "--interpret",
            "--slots",
            "256",
            "--batch",
            "1",
            "--keep",
            "1,0.5",
            "--kv-heads",
            "1",
            "--group",
            "2",
            "--head-dim",
            "16",
            "--iters",
            "1",
            "--max-candidates",
            "2",
            "--out",
            str(out),
        ]
    )
    res = json.loads(out.read_text())
    assert [(len(w["sweep"]), w.get("partial", False)) for w in written] == [(2, True), (4, True), (4, False)]
    assert len(res["sweep"]) == 4 and len(res["fastest_per_shape"]) == 2
    totals = {}
    for r in res["sweep"]:
        key = (r["block_size"], r["num_warps"], r["num_stages"], r["target_programs"])
        totals[key] = totals.get(key, 0.0) + r["seconds"]
    chosen = res["chosen"]
    assert totals[(chosen["block_size"], chosen["num_warps"], chosen["num_stages"], chosen["target_programs"])] == min(
        totals.values()
    )
    assert str(out) in chosen["measured"]


@pytest.mark.parametrize("block_size", [64, 128, 256])
def test_sweep_block_lists_cover_the_listed_slots(block_size):
    """The sweep re-expresses a list of 128-slot blocks in each candidate's blocks: the same slots when smaller,
    and when bigger, each listed block inside one of them and every one of them holding a listed block."""
    blocks = np.array([[[3, 0, 6], [5, 4, 1]]])

    def slots(bl, bs):
        return [{s for blk in row for s in range(blk * bs, (blk + 1) * bs)} for row in bl.reshape(-1, bl.shape[-1])]

    want, got = slots(blocks, 128), slots(np.asarray(bench.in_blocks_of(jnp.asarray(blocks), block_size)), block_size)
    for w, g in zip(want, got):
        if block_size <= 128:
            assert g == w
        else:
            assert w <= g and all(w & set(range(s, s + block_size)) for s in range(0, max(g) + 1, block_size) if s in g)
    assert bench.in_blocks_of(None, block_size) is None


def test_adjacent_pattern_lists_the_first_blocks_and_rows_say_which(tmp_path):
    """``--pattern random,adjacent``: one row per pattern below keep 1 (the same block count), one at keep 1."""
    _, _, _, bi, n_keep, nb = bench._inputs(1, 2, 2, 1024, 32, jnp.float32, 0.25, 128, pattern="adjacent")
    np.testing.assert_array_equal(np.asarray(bi), np.broadcast_to(np.arange(2), (1, 2, 2)))
    assert (n_keep, nb) == (2, 8)
    out = tmp_path / "pattern.json"
    args = ["--slots", "1024", "--batch", "1", "--keep", "1,0.25", "--kv-heads", "2", "--group", "2"]
    args += ["--head-dim", "32", "--dtype", "float32", "--iters", "1", "--loop", "1", "--out", str(out)]
    bench.main([*args, "--pattern", "random,adjacent"])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["keep"], r["pattern"], r["blocks_visited"]) for r in rows] == [
        (1.0, "all", 8),
        (0.25, "random", 2),
        (0.25, "adjacent", 2),
    ]
    with pytest.raises(SystemExit, match="--pattern"):
        bench.main([*args, "--pattern", "strided"])
