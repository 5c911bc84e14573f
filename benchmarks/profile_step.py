"""Where a decode step's (and a prefill's) device time goes: per-operation times from the JAX profiler, per method.

    python benchmarks/profile_step.py --length 32k --batch 8 --dtype bfloat16 \
        --methods full,quest,clusterkv,pqcache,chelsea,h2o,less,snapkv,chunkkv,streaming_llm,pyramidkv \
        --budgets 0.2 --token-budgets 2048 --out benchmarks/results/profile_h200_32k_b8.json
    python benchmarks/profile_step.py --report benchmarks/results/profile_h200_32k_b8.json   # the tables again

The setting is ``benchmarks/roofline.py``'s (attention + cache only, Llama-3.1-8B attention shapes, the method's own
``prefill`` on a random prompt, ``--steps`` decode steps in one compiled ``fori_loop`` as the engine runs them), for
one layer (``--layer``, default 2). Each variant's step program runs once to warm up, then once under
``jax.profiler.trace``; the trace (an XSpace, read with ``jax.profiler.ProfileData``: no TensorBoard needed) gives
every executed HLO operation's device time (on a GPU the kernels of the device plane; on a CPU the XLA thunks of
the host). Per variant (JSON keys in brackets):

- [``wall_ms``]: the traced call's wall time per step; [``device_ms``]: the device's busy time per step (the union
  of its kernels' intervals), so ``wall - device`` is what the device waited: host round trips of a ``while`` loop
  (the predicate copied back each trip), launches, argument handling; [``kernels``]: kernel launches per step;
  [``d2h``]: device-to-host copies per step (a ``while`` loop's predicate on a GPU);
- [``ops``]: every HLO operation with its summed time per step, launch count, opcode and the JAX source of its
  ``op_name`` metadata (``jit(loop)/while/body/...`` shortened to the method's function path), largest first;
  [``groups``]: the same summed by that shortened name, the table printed.

With ``--prefill``, each method's one-layer ``prefill`` is profiled the same way (``prefill`` rows): where its TTFT
goes (ClusterKV's K-means, H2O's accumulated scores, ...). Results are written after every variant, so a cut run
keeps what it profiled. ``--skip-done FILE`` skips the labels an earlier JSON holds at this commit (a rerun).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import command_line, commit, device_fields, parse_budgets, parse_contexts, write_json  # noqa: E402
from e2e import variants  # noqa: E402
from roofline_measure import (  # noqa: E402
    Variant,
    attention_config,
    build,
    compile_step,
    decode_inputs,
    plan_variant,
    random_prompt,
)

from kvjax.methods.base import Capacity  # noqa: E402

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S+.*?\s([a-z][\w\-]*)\(")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_SKIP = ("jit(", "while", "body", "cond", "pjit", "closed_call", "checkpoint", "remat", "jvp(", "transpose(")


def short_name(op_name: str, depth: int = 4) -> str:
    """The last ``depth`` meaningful components of an ``op_name`` (``jit(loop)/while/body/jit(decode)/dot_general``
    -> ``decode/dot_general``)."""
    parts = []
    for p in op_name.split("/"):
        if p.startswith("jit(") and p.endswith(")"):
            p = p[4:-1]
        if not p or p in ("while", "body", "cond", "loop", "step") or p.startswith(_SKIP[4:]):
            continue
        parts.append(p)
    return "/".join(parts[-depth:]) or op_name


def hlo_ops(hlo_text: str) -> dict[str, dict]:
    """Instruction name -> ``{"opcode", "op_name", "target"}`` from a compiled module's text."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, opcode = m.groups()
        op = _OPNAME.search(line)
        tgt = _TARGET.search(line)
        out[name] = {"opcode": opcode, "op_name": op.group(1) if op else "", "target": tgt.group(1) if tgt else ""}
    return out


def _union_ns(intervals) -> float:
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def read_trace(path: str, module_hint: str | None = None) -> dict:
    """The device's executed operations from an ``.xplane.pb``: ``{"ops": {hlo_op: [ns, count]}, "busy_ns",
    "kernels", "d2h"}``. On a GPU the device planes' kernels (their ``hlo_op`` stat); where there is no device
    plane (CPU), the host's XLA thunks. ``module_hint``: keep only events of HLO modules whose name contains it."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(path)
    planes = [p for p in pd.planes if p.name.startswith("/device:")]
    planes = planes or [p for p in pd.planes if p.name.startswith("/host:CPU")]
    ops: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    intervals, d2h, kernels = [], 0, 0
    for plane in planes:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                name = ev.name
                if "memcpy" in name.lower() and ("dtoh" in name.lower() or "d2h" in name.lower()):
                    d2h += 1
                op = stats.get("hlo_op") or (name if plane.name.startswith("/device:") else None)
                if not op or name.startswith("end: ") or "memcpy" in name.lower() and "hlo_op" not in stats:
                    continue
                if module_hint and module_hint not in str(stats.get("hlo_module", "")):
                    continue
                ops[op][0] += ev.duration_ns
                ops[op][1] += 1
                kernels += 1
                intervals.append((ev.start_ns, ev.start_ns + ev.duration_ns))
    return {"ops": dict(ops), "busy_ns": _union_ns(intervals), "kernels": kernels, "d2h": d2h}


def profile_call(fn, *args, module_hint=None) -> tuple[float, dict]:
    """Run ``fn(*args)`` once under the profiler; (wall seconds, ``read_trace`` of it)."""
    d = tempfile.mkdtemp(prefix="kvjax_profile_")
    jax.profiler.start_trace(d)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    wall = time.perf_counter() - t0
    jax.profiler.stop_trace()
    paths = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
    if not paths:
        raise RuntimeError(f"the profiler wrote no .xplane.pb under {d}")
    return wall, read_trace(paths[0], module_hint), out


def summarise(trace: dict, hlo: dict[str, dict], per: int, top: int = 40) -> tuple[list, list]:
    """(ops, groups): per-``per`` (steps) milliseconds of each operation and of each shortened source name."""
    ops = []
    for op, (ns, count) in trace["ops"].items():
        info = hlo.get(op, {"opcode": "?", "op_name": "", "target": ""})
        kind = info["target"] or info["opcode"]
        ops.append(
            {
                "op": op,
                "ms": ns / 1e6 / per,
                "launches": count / per,
                "opcode": kind,
                "source": short_name(info["op_name"]) if info["op_name"] else op,
            }
        )
    ops.sort(key=lambda r: -r["ms"])
    groups = collections.defaultdict(lambda: [0.0, 0.0, set()])
    for r in ops:
        g = groups[r["source"]]
        g[0] += r["ms"]
        g[1] += r["launches"]
        g[2].add(r["opcode"])
    gl = [{"source": k, "ms": v[0], "launches": v[1], "opcodes": sorted(v[2])} for k, v in groups.items()]
    gl.sort(key=lambda r: -r["ms"])
    return ops[:top], gl[:top]


def row_text(r: dict, top: int) -> str:
    head = (
        f"{r['label']} [{r['phase']}]: wall {r['wall_ms']:.3f} ms, device busy {r['device_ms']:.3f} ms "
        f"({100 * r['device_ms'] / max(r['wall_ms'], 1e-9):.0f}%), {r['kernels']:.1f} kernels, {r['d2h']:.1f} D2H "
        f"copies per {'step' if r['phase'] == 'decode' else 'prefill'}"
    )
    lines = [head, f"  {'ms':>8} {'launch':>6}  {'kind':<22} source"]
    for g in r["groups"][:top]:
        lines.append(f"  {g['ms']:8.3f} {g['launches']:6.1f}  {','.join(g['opcodes'])[:22]:<22} {g['source']}")
    return "\n".join(lines)


def report(data: dict, top: int = 8) -> str:
    lines = [
        f"profile: {data['setting']}; {data['device_kind']} ({data['backend']}), jax {data['jax_version']}, "
        f"commit {data['commit']}; {data['length']} tokens, batch {data['batch']}, {data['dtype']}, layer "
        f"{data['layer']}, {data['steps']} steps per call",
        "",
        f"{'label':<20} {'phase':<8} {'wall ms':>8} {'device ms':>9} {'busy%':>5} {'kernels':>8} {'D2H':>5}  top op",
    ]
    for r in data["rows"]:
        if r.get("status") != "ok":
            lines.append(f"{r['label']:<20} {r.get('phase', ''):<8} skipped: {r.get('skipped')}")
            continue
        top_op = r["groups"][0]["source"] if r["groups"] else ""
        lines.append(
            f"{r['label']:<20} {r['phase']:<8} {r['wall_ms']:8.3f} {r['device_ms']:9.3f} "
            f"{100 * r['device_ms'] / max(r['wall_ms'], 1e-9):5.0f} {r['kernels']:8.1f} {r['d2h']:5.1f}  {top_op}"
        )
    lines.append("")
    lines += [row_text(r, top) + "\n" for r in data["rows"] if r.get("status") == "ok"]
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=parse_contexts, default=[32768], help="prompt tokens (one value: 32k, 32768)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--methods",
        default="full,quest,clusterkv,pqcache,chelsea,h2o,less,snapkv,chunkkv,streaming_llm,pyramidkv",
        help="comma-separated registered method names (full only when named)",
    )
    p.add_argument("--budgets", type=parse_budgets, default=[0.2])
    p.add_argument("--token-budgets", type=parse_budgets, default=[2048], help="recall methods also at these")
    p.add_argument("--layer", type=int, default=2, help="the layer profiled (its number sets per-layer rules)")
    p.add_argument("--steps", type=int, default=8, help="decode steps in the profiled program")
    p.add_argument("--prefill", action="store_true", help="also profile each method's one-layer prefill")
    p.add_argument("--top", type=int, default=8, help="source groups printed per variant")
    p.add_argument("--tag", default="", help="appended to every label (e.g. the kernel choice an env var forced)")
    p.add_argument("--tiny", action="store_true", help="the 4-head test config (smoke tests)")
    p.add_argument("--skip-done", default=None, help="a JSON of an earlier run: skip its labels at this commit")
    p.add_argument("--out", default="benchmarks/results/profile.json", help="written after every variant")
    p.add_argument("--append", action="store_true", help="keep the rows of an existing --out (same setting)")
    p.add_argument("--report", default=None, help="print the tables of a written JSON and exit")
    a = p.parse_args(argv)
    if len(a.length) != 1:
        p.error(f"--length takes one prompt length, got {a.length}")
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    return a


def _done(path, sha) -> set:
    if not path or not Path(path).exists():
        return set()
    old = json.loads(Path(path).read_text())
    if old.get("commit") != sha:
        return set()
    return {(r["label"], r["phase"]) for r in old["rows"] if r.get("status") == "ok"}


def profile_variant(cfg, var: Variant, layer, batch, n, dtype, steps, do_prefill) -> list[dict]:
    """The decode-step row (and with ``do_prefill`` the prefill row) of one variant."""
    cap = Capacity(n, 2 * steps + 1)
    plan_variant(cfg, var, [layer], batch, n, cap, dtype)
    if var.skipped:
        return [{"label": var.label, "phase": "decode", "status": "skipped", "skipped": var.skipped}]
    rows = []
    run = build(cfg, var, [layer], batch, n, cap, dtype)  # runs the compiled prefill once (its warm-up)
    if do_prefill:
        q, k, v = random_prompt(jax.random.PRNGKey(layer), batch, n, cfg, dtype)
        m = var.method.at(layer)
        st = jax.block_until_ready(m.init(cfg, batch, cap, layer, dtype))
        lengths = jnp.full((batch,), n, jnp.int32)
        kw = {"previous": None} if m.reuses_previous_layer else {}  # as compiled: the profiled layer alone
        compiled = var.prefills[layer]
        inner = getattr(compiled, "compiled", compiled)
        wall, tr, _ = profile_call(lambda: compiled(st, q=q, k=k, v=v, lengths=lengths, **kw))
        ops, groups = summarise(tr, hlo_ops(inner.as_text()), 1)
        rows.append(_row(var, "prefill", wall, tr, ops, groups, 1))
        del q, k, v, st
    args = decode_inputs(cfg, batch, dtype)
    pos = jnp.full((batch,), n, jnp.int32)
    compile_step(run, [layer], args, pos, steps)
    out, run.states = run.step(run.states, *args, pos)  # warm-up
    jax.block_until_ready(out)
    wall, tr, (out, run.states) = profile_call(lambda: run.step(run.states, *args, pos + steps))
    ops, groups = summarise(tr, hlo_ops(run.step.as_text()), steps)
    rows.insert(0, _row(var, "decode", wall, tr, ops, groups, steps))
    return rows


def _row(var, phase, wall, tr, ops, groups, per) -> dict:
    return {
        "label": var.label,
        "method": var.name,
        "budget": var.budget,
        "phase": phase,
        "status": "ok",
        "wall_ms": wall * 1e3 / per,
        "device_ms": tr["busy_ns"] / 1e6 / per,
        "kernels": tr["kernels"] / per,
        "d2h": tr["d2h"] / per,
        "ops": ops,
        "groups": groups,
    }


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.report:
        print(report(json.loads(Path(a.report).read_text()), a.top))
        return 0
    cfg = attention_config(a.tiny)
    n, dtype = a.length[0], jnp.dtype(a.dtype)
    sha = commit()
    data = {
        "benchmark": "profile_step",
        "setting": f"attention + cache only, one layer, {'tiny' if a.tiny else 'Llama-3.1-8B'} attention shapes "
        f"({cfg.num_heads}/{cfg.num_kv_heads} x {cfg.head_dim})",
        **device_fields(),
        "commit": sha,
        "command": command_line(),
        "length": n,
        "batch": a.batch,
        "dtype": a.dtype,
        "layer": a.layer,
        "steps": a.steps,
        "rows": [],
    }
    done = _done(a.skip_done, sha)
    if done:
        data["rows"] = [r for r in json.loads(Path(a.skip_done).read_text())["rows"] if r.get("status") == "ok"]
    out = Path(a.out)
    if a.append and out.exists():
        old = json.loads(out.read_text())
        same = all(old.get(k) == data[k] for k in ("length", "batch", "dtype", "layer", "steps"))
        if not same:
            raise ValueError(f"--append: {out} holds another setting; write to another --out")
        data["rows"] = old["rows"] + data["rows"]
    names = [m.strip() for m in a.methods.split(",") if m.strip()]
    for label, method, budget in variants(names, a.budgets, a.token_budgets, (1,)):
        if label == "full" and "full" not in names:
            continue
        label += f" [{a.tag}]" if a.tag else ""
        if (label, "decode") in done:
            print(f"{label}: done at this commit, skipped", flush=True)
            continue
        t0 = time.perf_counter()
        rows = profile_variant(cfg, Variant(label, method, budget), a.layer, a.batch, n, dtype, a.steps, a.prefill)
        data["rows"].extend(rows)
        write_json(out, data, default=str)
        for r in rows:
            print(row_text(r, a.top) if r["status"] == "ok" else f"{label}: skipped: {r['skipped']}", flush=True)
        print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
        jax.clear_caches()
    print(report(data, a.top))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
