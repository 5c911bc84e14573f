"""How long each line of ``.ci/run`` takes, and what it passed: the times the README and docs/testing.md state.

Runs every command of ``.ci/run`` in order, and the fast first check (``python3 -m pytest -q -m smoke``) after the
install, in the repository root (a clean clone, as CI runs it), each step's output streamed; stops at the first
failing step, as CI does. Writes a JSON (commit, machine, jax version, load average, and per step: its command,
wall seconds, exit status and pytest's counts) and prints the markdown table that docs/testing.md holds between its
``<!-- ci_times -->`` marks (``tests/test_ci_times.py`` checks that table, and the README's "about N minutes",
against the JSON)::

    python3 benchmarks/ci_times.py --out benchmarks/results/ci_times.json   # about an hour on 2 cores
    python3 benchmarks/ci_times.py --readme --out benchmarks/results/ci_times.json  # then the README's commands
    python3 benchmarks/ci_times.py --render benchmarks/results/ci_times.json  # the table only

Measure on a machine running nothing else: the times are what a user of a 2-core machine waits. The steps run with a
fresh ``TMPDIR``, so the tests' compilation cache starts empty as on a CI machine."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

SMOKE = ("smoke", "python3 -m pytest -q -m smoke")
#: The README's commands whose times it states (``--readme`` times them; the quickstart is the README's own block).
README_COMMANDS = (
    ("quickstart", "python3 benchmarks/ci_times.py --quickstart"),
    ("kvjax generate", 'kvjax generate --method h2o --budget 0.2 --prompt "Summarise the essay: ..."'),
    ("kvjax demo", "kvjax demo"),
    (
        "kvjax-train-less",
        'kvjax-train-less --out "$TMPDIR/less-small" --seq-len 256 --num-seqs 16 --epochs 2 --rank 4 --hidden 32 '
        "--batch 4",
    ),
)
#: pytest's last line: "1559 passed, 290 skipped, 45 warnings in 724.69s (0:12:04)"
SUMMARY = re.compile(r"^=*\s*(?P<counts>(?:\d+ \w+(?:, )?)+) in [\d.]+s", re.M)
#: A step's name from its command: the pytest selection, the script or the command line's first word.
NAMES = (
    (re.compile(r"kvjax-eval main"), "main job"),
    (re.compile(r"scripts/install\.sh"), "install"),
    (re.compile(r"-m extended"), "extended line"),
    (re.compile(r"--runslow"), "slow line"),
    (re.compile(r"-m smoke"), "smoke"),
    (re.compile(r"mutations\.py"), "mutants (ci subset)"),
    (re.compile(r"pytest"), "default line"),
)


def name_of(command: str) -> str:
    return next(name for pattern, name in NAMES if pattern.search(command))


def steps(ci: Path) -> list[tuple[str, str]]:
    """The commands of a CI script (continued lines joined; ``set``, ``cd`` and ``export`` skipped), a command
    joined by ``&&`` split into its parts, each with its name (:data:`NAMES`)."""
    text = re.sub(r"\s*\\\n\s*", " ", ci.read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line.split()[0] in ("set", "cd", "export"):
            continue
        out += [(name_of(part.strip()), part.strip()) for part in line.split("&&")]
    return out


def counts(output: str) -> dict[str, int]:
    """pytest's counts from the last summary line of ``output`` (``{"passed": 1559, "skipped": 290, ...}``)."""
    found = SUMMARY.findall(output)
    if not found:
        return {}
    return {word: int(n) for n, word in (c.split() for c in found[-1].split(", "))}


def run_step(name: str, command: str, env: dict) -> dict:
    print(f"[ci_times] {name}: {command}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        ["bash", "-c", command], cwd=bc.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    rc = proc.wait()
    seconds = time.perf_counter() - t0
    print(f"[ci_times] {name}: {seconds:.0f} s, exit {rc}", flush=True)
    return {"name": name, "command": command, "seconds": round(seconds, 1), "rc": rc, **counts("".join(lines))}


def machine() -> dict:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln]
    cpu = names[0] if names else platform.processor() or None
    return {"cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "load_average": bc.load_average()}


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def render(data: dict) -> str:
    """The markdown table docs/testing.md holds: one row per step."""
    rows = [
        "| step | command | passed | skipped | time |",
        "|---|---|---|---|---|",
    ]
    for s in data["steps"]:
        rows.append(
            f"| {s['name']} | `{s['command']}` | {s.get('passed', '-')} | {s.get('skipped', '-')} | "
            f"{minutes(s['seconds'])} |"
        )
    ci = sum(s["seconds"] for s in data["steps"] if s["name"] != "smoke")
    rows += ["", f"`.ci/run` in all: {minutes(ci)}. {_measured(data, '')}"]
    if data.get("readme"):
        rows += ["", "| the README's command | time |", "|---|---|"]
        rows += [f"| `{s['command']}` | {minutes(s['seconds'])} |" for s in data["readme"]["steps"]]
        rows += ["", _measured(data["readme"], " --readme")]
    return "\n".join(rows)


def _measured(data: dict, flag: str) -> str:
    m = data["machine"]
    return (
        f"Measured by `python3 benchmarks/ci_times.py{flag}` at commit `{data['commit'][:7]}` ({data['date']}, "
        f"{m['cpus']} CPU cores, {m['cpu']}, Python {m['python']}, jax {data['jax_version']}; "
        "[ci_times.json](../benchmarks/results/ci_times.json))."
    )


def quickstart() -> None:
    """Run the README's quickstart block as it is written."""
    readme = (bc.ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Quickstart\n.*?```python\n(.*?)```", readme, re.S).group(1)
    exec(compile(block, "README.md quickstart", "exec"), {"__name__": "__main__"})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/ci_times.json", help="the JSON to write")
    p.add_argument("--ci", default=str(bc.ROOT / ".ci" / "run"), help="the CI script whose commands to run")
    p.add_argument("--render", metavar="JSON", help="print the docs' table of a JSON written before, run nothing")
    p.add_argument(
        "--readme", action="store_true", help="time the README's commands instead (kvjax installed), into --out's JSON"
    )
    p.add_argument("--quickstart", action="store_true", help="run the README's quickstart block, nothing else")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the steps --out holds that passed; run the others (from a failed one)",
    )
    args = p.parse_args(argv)
    if args.quickstart:
        quickstart()
        return 0
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return 0
    # a fresh TMPDIR: the tests' compilation cache ($TMPDIR/kvjax-test-jax-cache) starts empty, as on a CI machine
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": tempfile.mkdtemp(prefix="kvjax-ci-times-")}
    run = {
        "commit": bc.commit(),
        "dirty": bc.git_dirty(),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "steps": [],
    }
    if args.readme:
        todo = list(README_COMMANDS)
        whole = json.loads(Path(args.out).read_text())
    else:
        todo = steps(Path(args.ci))
        at = next((i + 1 for i, (name, _) in enumerate(todo) if name == "install"), 0)
        todo = todo[:at] + [SMOKE] + todo[at:]  # the smoke check needs kvjax installed
        whole = run
    if args.resume and Path(args.out).exists():
        held = whole.get("readme", {}) if args.readme else json.loads(Path(args.out).read_text())
        passed = {s["command"]: s for s in held.get("steps", []) if s["rc"] == 0}
        run["resumed_from"] = {k: held.get(k) for k in ("commit", "date")}
    else:
        passed = {}
    for name, command in todo:
        if command in passed:  # an interrupted measurement resumes: this step passed in the run --out holds
            run["steps"].append(passed[command])
            continue
        run["steps"].append(run_step(name, command, env))
        run["jax_version"] = run.get("jax_version") or _jax_version()  # known once a step has installed jax
        if args.readme:
            whole["readme"] = run
        bc.write_json(args.out, whole)
        if run["steps"][-1]["rc"]:
            print(f"[ci_times] stopped: {name} failed", flush=True)
            return run["steps"][-1]["rc"]
    print(render(whole))
    return 0


def _jax_version() -> str | None:
    try:
        return subprocess.run(
            [sys.executable, "-c", "import jax; print(jax.__version__)"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
