"""Decode-attention kernel benchmark: kernel vs reference time, achieved K/V bandwidth, block skipping.

    python benchmarks/decode_attention.py --slots 4096,16384,32768 --batch 1,8 --keep 1,0.5,0.25,0.1 \\
        --out benchmarks/results/decode_attention.json

For every (slots, batch, keep fraction) it times ``decode_attention`` with ``--impl`` (default: by backend)
and the XLA path (``impl="xla"``, the CPU default, so on CPU the two are one program; ``reference_gbs`` counts all
``S`` slots, as the path read before it gathered the listed blocks), both jitted, compile excluded: seconds per
call = ``(T(loop) - T(1)) / (loop - 1)``, ``T(m)`` the median of ``--iters`` host-timed runs of a program that
calls it ``m`` times in a loop (``--loop``, default 16), so the fixed cost of a jitted call (dispatch, launch,
synchronisation: ~120 us on the H200 of
``benchmarks/results/archive/decode_attention_h200_timing_calls.txt``, which was timed with ``--loop 1`` and so
measured that cost more than the kernel below 32k slots x batch 8) is not counted as kernel time.
``keep < 1`` lists a random ``keep`` fraction of the slot blocks per (batch row, KV head) in ``block_indices``;
``--pattern random,adjacent`` adds a row listing the *first* ``keep`` fraction (the same blocks count and bytes from
contiguous addresses: the two rows' difference is what the access pattern costs, e.g. on XLA:CPU, where the listed
blocks are gathered). Reported: ``kv_bytes_read`` = bytes of K and V in the visited blocks (what the kernel must read),
achieved bandwidth = kv_bytes_read / kernel time, its fraction of the device's peak HBM bandwidth
(``benchmarks/decode.py``'s table, or ``--bandwidth-gbs``), the speedup over the reference, and the speedup over the
same kernel at ``keep = 1`` (ideal: ``1 / keep``). JSON includes the jax version and the device.
On CPU the default impl is ``xla``; ``--impl pallas_gpu --interpret`` runs a tiny smoke test.

``--sweep`` tunes the kernel: it times every candidate of
``kernels_pallas.decode_attention.tuning.CANDIDATES[impl]`` (block size; on GPU also Triton's warps and stages and
the split's target program count) at every (slots, batch, keep), prints the fastest per shape and the candidate
with the lowest total time as the ``tuning.TABLE`` row to keep, and writes all of it to the JSON (``sweep``,
``chosen``). The target setting on an H100:

    python benchmarks/decode_attention.py --sweep --slots 32768 --batch 8 --keep 1,0.5,0.25,0.1 \\
        --out benchmarks/results/decode_attention_sweep_h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import device_fields, write_json  # noqa: E402
from decode import peak_bandwidth_gbs  # noqa: E402  (the peak-bandwidth table lives in benchmarks/decode.py)

from kernels_pallas.decode_attention import IMPLS, decode_attention, default_impl, tuning  # noqa: E402


def _time(fn, args, iters: int) -> float:
    """Median seconds of one jitted call, host-timed: dispatch and synchronisation included."""
    jax.block_until_ready(fn(*args))  # compile + warm-up
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _repeat(fn, n: int):
    """``fn`` run ``n`` times inside one jitted ``fori_loop``; each run's ``q`` depends on the last one's output
    (``q + 1e-30 * o``, which leaves ``q`` unchanged in value), so XLA can neither hoist nor merge the calls."""

    def looped(q, k, v, bi):
        def body(_, q):
            o = fn(q, k, v, bi)[0]
            return q + (o * 1e-30).astype(q.dtype)

        return jax.lax.fori_loop(0, n, body, q)

    return jax.jit(looped)


def _time_device(fn, args, iters: int, n: int) -> float:
    """Seconds per call with the fixed cost of a jitted call (Python dispatch, launch of the program,
    ``block_until_ready``) taken out: ``(T(n) - T(1)) / (n - 1)``, ``T(m)`` the median host time of a program that
    calls ``fn`` ``m`` times in a loop (:func:`_repeat`). At 32k slots, batch 1 that fixed cost (~120 us on an H200
    with jax 0.11) is larger than the kernel itself. ``n <= 1``: the host-timed single call (:func:`_time`)."""
    if n <= 1:
        return _time(fn, args, iters)
    return max((_time(_repeat(fn, n), args, iters) - _time(_repeat(fn, 1), args, iters)) / (n - 1), 1e-9)


def _header(args, impl: str, dtype, peak) -> dict:
    """The JSON fields every run of this script writes: versions, device, kernel and shapes."""
    return {
        **device_fields(),
        "python": platform.python_version(),
        "impl": impl,
        "interpret": args.interpret,
        "dtype": str(dtype),
        "kv_heads": args.kv_heads,
        "group": args.group,
        "head_dim": args.head_dim,
        "peak_bandwidth_gbs": peak,
        "iters": args.iters,
        "loop": args.loop,
    }


def _write(args, header: dict, **results) -> None:
    write_json(args.out, {**header, **results}, indent=2)


def _inputs(batch, hkv, g, s, d, dtype, keep, block_size, seed=0, pattern="random"):
    """Random ``q [B, Hkv G, D]``, ``k, v [B, Hkv, S, D]`` and ``block_indices [B, Hkv, n_keep]`` (None when every
    block is kept): ``pattern="random"`` lists a random ``keep`` fraction of the blocks per ``(b, h)``,
    ``"adjacent"`` the first ``n_keep`` blocks (the same count and bytes, read from contiguous addresses)."""
    kq, kk, kv, ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (batch, hkv * g, d), dtype)
    k = jax.random.normal(kk, (batch, hkv, s, d), dtype)
    v = jax.random.normal(kv, (batch, hkv, s, d), dtype)
    nb = -(-s // block_size)
    n_keep = max(1, int(round(keep * nb)))
    if n_keep >= nb:
        return q, k, v, None, nb, nb
    if pattern == "adjacent":
        return q, k, v, jnp.broadcast_to(jnp.arange(n_keep, dtype=jnp.int32), (batch, hkv, n_keep)), n_keep, nb
    order = jnp.argsort(jax.random.uniform(ks, (batch, hkv, nb)), axis=-1)
    return q, k, v, order[..., :n_keep].astype(jnp.int32), n_keep, nb


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", default="4096,16384,32768")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--keep", default="1,0.5,0.25,0.1", help="fractions of slot blocks visited")
    p.add_argument(
        "--pattern",
        default="random",
        help="which blocks keep < 1 lists, comma-separated: random (per batch row and KV head), adjacent (the first "
        "ones: same bytes from contiguous addresses, so the difference is the cost of the access pattern)",
    )
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head (GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impl", default=None, choices=IMPLS, help="kernel under test (default: by backend)")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke test only)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--loop",
        type=int,
        default=16,
        help="calls per timed program: seconds per call = (T(loop) - "
        "T(1)) / (loop - 1), the fixed cost of a jitted call taken out; 1: one host-timed call",
    )
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="device peak memory bandwidth, GB/s")
    p.add_argument("--out", default="benchmarks/results/decode_attention.json")
    p.add_argument("--sweep", action="store_true", help="time every tuning candidate (tuning.CANDIDATES[impl])")
    p.add_argument("--max-candidates", type=int, default=None, help="with --sweep: only the first N (smoke runs)")
    return p


def _row(s, batch, keep, n_keep, nb, t_k, t_r, row_bytes, bs, peak) -> dict:
    """One measured shape: the kernel's and the reference's seconds, the K/V bytes the kernel reads (``row_bytes``
    per slot, ``n_keep`` of ``nb`` blocks of ``bs``) and the reference reads (all ``s`` slots), GB/s and ratios."""
    kv_read = batch * row_bytes * min(n_keep * bs, s)
    r = {
        "slots": s,
        "batch": batch,
        "keep": keep,
        "blocks_visited": n_keep,
        "blocks": nb,
        "skipped_fraction": 1 - n_keep / nb,
        "kernel_seconds": t_k,
        "reference_seconds": t_r,
        "kv_bytes_read": kv_read,
        "kernel_gbs": kv_read / t_k / 1e9,
        "reference_gbs": batch * row_bytes * s / t_r / 1e9,
        "speedup_vs_reference": t_r / t_k,
    }
    if peak:
        r["kernel_hbm_fraction"] = r["kernel_gbs"] / peak
        r["reference_hbm_fraction"] = r["reference_gbs"] / peak
    return r


def _print_row(r: dict, peak) -> None:
    print(
        f"S={r['slots']:6d} B={r['batch']:2d} keep={r['keep']:4.2f} {r.get('pattern', ''):8s} "
        f"kernel {r['kernel_seconds'] * 1e6:9.1f} us  "
        f"ref {r['reference_seconds'] * 1e6:9.1f} us  x{r['speedup_vs_reference']:5.2f} vs ref  "
        f"{r['kernel_gbs']:7.1f} GB/s"
        + (f" ({100 * r['kernel_hbm_fraction']:4.1f}% of HBM)" if peak else "")
        + (
            f"  x{r['speedup_vs_kernel_full']:.2f} vs keep=1 (ideal x{r['ideal_speedup_vs_kernel_full']:.2f})"
            if "speedup_vs_kernel_full" in r
            else ""
        ),
        flush=True,
    )


def _keeps(args):
    """``(keep, pattern)`` pairs in ``--keep`` order: each ``--pattern`` for a fraction below 1, one row at 1."""
    patterns = [x.strip() for x in args.pattern.split(",") if x.strip()]
    bad = sorted(set(patterns) - {"random", "adjacent"})
    if bad or not patterns:
        raise SystemExit(f"--pattern: {bad or 'empty'} is not one of random, adjacent (comma-separated)")
    keeps = [float(x) for x in args.keep.split(",")]
    return [(kp, pt) for kp in keeps for pt in (patterns if kp < 1 else patterns[:1])]


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.sweep:
        return sweep(args)

    impl = args.impl or default_impl()
    dtype = jnp.dtype(args.dtype)
    dev = jax.devices()[0]
    peak = args.bandwidth_gbs or peak_bandwidth_gbs(dev)
    bs, hkv, g, d = args.block_size, args.kv_heads, args.group, args.head_dim
    kernel = jax.jit(
        lambda q, k, v, bi: decode_attention(
            q, k, v, block_indices=bi, impl=impl, block_size=bs, interpret=args.interpret
        )
    )
    ref = jax.jit(lambda q, k, v, bi: decode_attention(q, k, v, block_indices=bi, impl="xla", block_size=bs))
    rows = []

    def write():
        _write(args, _header(args, impl, dtype, peak), block_size=bs, rows=rows)

    print(
        f"{jax.__version__} {dev.device_kind} impl={impl} dtype={dtype} Hkv={hkv} G={g} D={d} bs={bs} peak={peak} GB/s",
        flush=True,
    )
    for s in [int(x) for x in args.slots.split(",")]:
        for batch in [int(x) for x in args.batch.split(",")]:
            full_t = None
            for keep, pattern in _keeps(args):
                q, k, v, bi, n_keep, nb = _inputs(batch, hkv, g, s, d, dtype, keep, bs, pattern=pattern)
                t_k = _time_device(kernel, (q, k, v, bi), args.iters, args.loop)
                t_r = _time_device(ref, (q, k, v, bi), args.iters, args.loop)
                r = _row(s, batch, keep, n_keep, nb, t_k, t_r, hkv * 2 * d * dtype.itemsize, bs, peak)
                r["pattern"] = pattern if bi is not None else "all"
                full_t = t_k if keep >= 1 else full_t
                if full_t is not None:
                    r["speedup_vs_kernel_full"] = full_t / t_k
                    r["ideal_speedup_vs_kernel_full"] = nb / n_keep
                rows.append(r)
                write()
                _print_row(r, peak)
    print(f"wrote {args.out}")


def kernel_with(impl: str, cand: "tuning.Tuning", interpret: bool):
    """A jitted ``(q, k, v, block_indices) -> partials`` of ``impl``'s kernel at the candidate's knobs."""
    if impl == "pallas_gpu":
        from kernels_pallas.decode_attention.pallas_gpu import decode_attention_gpu as fn

        kw = dict(num_warps=cand.num_warps, num_stages=cand.num_stages, target_programs=cand.target_programs)
    elif impl == "pallas_tpu":
        from kernels_pallas.decode_attention.pallas_tpu import decode_attention_tpu as fn

        kw = {}
    else:
        return jax.jit(
            lambda q, k, v, bi: decode_attention(q, k, v, block_indices=bi, impl="xla", block_size=cand.block_size)
        )
    return jax.jit(
        lambda q, k, v, bi: fn(q, k, v, block_indices=bi, block_size=cand.block_size, interpret=interpret, **kw)
    )


def in_blocks_of(blocks, block_size: int):
    """A list of 128-slot blocks ``[..., N]`` as blocks of ``block_size`` slots (None stays None): each 128-slot
    block is ``128 / block_size`` smaller ones, or lies inside one bigger block (listed once per 128-slot block:
    repeats count once)."""
    if blocks is None or block_size == 128:
        return blocks
    if block_size < 128:
        r = 128 // block_size
        return (blocks[..., None] * r + jnp.arange(r)).reshape(*blocks.shape[:-1], -1)
    return blocks * 128 // block_size


def _fastest_per_shape(rows, shapes, peak) -> list[dict]:
    """The fastest candidate's row at each shape (printed), of the rows that ran there."""
    per_shape = []
    for s, batch, keep in shapes:
        ok = [r for r in rows if (r["slots"], r["batch"], r["keep"]) == (s, batch, keep) and "seconds" in r]
        if ok:
            f = min(ok, key=lambda r: r["seconds"])
            per_shape.append(f)
            print(
                f"S={s:6d} B={batch:2d} keep={keep:4.2f} fastest: block {f['block_size']} warps {f['num_warps']} "
                f"stages {f['num_stages']} programs {f['target_programs']}  {f['seconds'] * 1e6:8.1f} us  "
                f"{f['gbs']:7.1f} GB/s" + (f" ({100 * f['hbm_fraction']:4.1f}% of HBM)" if peak else ""),
                flush=True,
            )
    return per_shape


def sweep(args) -> int:
    """``--sweep``: every candidate at every shape; the fastest per shape and overall (module docstring). The JSON is
    written after every candidate (``partial: true`` until the last), so a run cut at its time limit keeps what it
    timed."""
    impl = args.impl or default_impl()
    dtype = jnp.dtype(args.dtype)
    dev = jax.devices()[0]
    peak = args.bandwidth_gbs or peak_bandwidth_gbs(dev)
    hkv, g, d = args.kv_heads, args.group, args.head_dim
    cands = tuning.CANDIDATES[impl][: args.max_candidates]
    shapes = [
        (s, b, keep)
        for s in map(int, args.slots.split(","))
        for b in map(int, args.batch.split(","))
        for keep in map(float, args.keep.split(","))
    ]
    rows, totals = [], {}
    print(
        f"{jax.__version__} {dev.device_kind} sweep impl={impl} dtype={dtype} Hkv={hkv} G={g} D={d}: "
        f"{len(cands)} candidates x {len(shapes)} shapes",
        flush=True,
    )
    for cand in cands:
        fn, total = kernel_with(impl, cand, args.interpret), 0.0
        for s, batch, keep in shapes:
            # the same slots are listed for every candidate: keep is a fraction of 128-slot blocks, re-expressed
            # in the candidate's blocks (a candidate block is listed if it holds a listed 128-slot block)
            q, k, v, bi, n_keep, nb = _inputs(batch, hkv, g, s, d, dtype, keep, 128)
            bi = in_blocks_of(bi, cand.block_size)
            try:
                t = _time_device(fn, (q, k, v, bi), args.iters, args.loop)
            except Exception as e:  # a candidate that does not compile here (e.g. shared memory): recorded
                rows.append(
                    {
                        **dataclasses.asdict(cand),
                        "slots": s,
                        "batch": batch,
                        "keep": keep,
                        "error": f"{type(e).__name__}: {str(e)[:300]}",
                    }
                )
                total = float("inf")
                print(f"  {cand} S={s} B={batch} keep={keep}: failed ({type(e).__name__})", flush=True)
                continue
            kv_read = batch * hkv * 2 * d * dtype.itemsize * min(n_keep * 128, s)
            r = {
                **dataclasses.asdict(cand),
                "slots": s,
                "batch": batch,
                "keep": keep,
                "seconds": t,
                "kv_bytes_read": kv_read,
                "gbs": kv_read / t / 1e9,
            }
            if peak:
                r["hbm_fraction"] = r["gbs"] / peak
            rows.append(r)
            total += t
        totals[cand] = total
        _write(args, _header(args, impl, dtype, peak), sweep=rows, partial=True)  # a cut run keeps its rows
    ran = {c: t for c, t in totals.items() if np.isfinite(t)}  # candidates that ran at every shape
    per_shape = _fastest_per_shape(rows, shapes, peak)
    chosen = None
    if ran:
        chosen = dataclasses.replace(
            min(ran, key=ran.get), measured=f"{args.out} ({dev.device_kind}, jax {jax.__version__})"
        )
    print(f"chosen (lowest total time): {chosen!r}" if chosen else "chosen: none (no candidate ran at every shape)")
    _write(
        args,
        _header(args, impl, dtype, peak),
        sweep=rows,
        fastest_per_shape=per_shape,
        chosen=chosen and dataclasses.asdict(chosen),
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
