"""A resumable, growable output folder: ``rows.jsonl`` holds a run's settings, then one record per finished cell.

The first line is ``{"settings": {...}}``: everything the rows depend on. A run into the same folder must agree with
it, except in the *grid* settings (lists and dicts the caller names, e.g. methods, ratios, budgets, lengths), which
it may extend: the header then holds the union, and the run computes only the cells no record holds yet. Every
finished cell appends one JSON line, flushed and fsynced, so a killed run loses at most the cell it was computing
(a line cut short by the kill is dropped when the file is opened again).

Used by ``kvjax-eval leaderboard`` (:mod:`eval.leaderboard`), ``kvjax-eval niah`` (:mod:`eval.niah`) and the task
commands (``main``, ``needle``, ``perplexity``, ...: :mod:`eval.runner`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

ROWS = "rows.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    """The whole JSON lines of a file (none if it does not exist; a line cut short by a kill is dropped)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _plain(x: Any) -> Any:
    """``x`` as JSON gives it back (tuples become lists, keys strings)."""
    return json.loads(json.dumps(x, default=_jsonable))


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def tupled(x: Any) -> Any:
    """``x`` read back from JSON with its lists as tuples again (method options such as Chelsea's ``outlier_heads``
    are tuples: hashable, as a jitted method's static config must be)."""
    if isinstance(x, list):
        return tuple(tupled(v) for v in x)
    if isinstance(x, dict):
        return {k: tupled(v) for k, v in x.items()}
    return x


def _members(held: dict, name: str | None) -> set:
    """The names a folder's grid list ``name`` holds: its entries, or a list entry's first element (a NIAH run's
    ``[method, budget]`` configs)."""
    return {x[0] if isinstance(x, list) else x for x in held.get(name) or []} if name else set()


def merge_settings(
    held: dict,
    wanted: dict,
    grid: Sequence[str],
    defaults: dict | None = None,
    what: str = "run",
    out: Any = "",
    owners: dict | None = None,
) -> dict:
    """The settings a folder holds after a run of ``wanted`` extends one of ``held``: equal outside ``grid``; each
    ``grid`` list the union in order (``held``'s first), each ``grid`` dict the union of its keys (a key both hold must
    map to the same value). ``owners``: a grid dict's keys named by a grid list (``{"options": "methods"}``): a
    member the folder already ran without an entry ran with ``{}`` (its defaults), so new values for it are a clash,
    not an addition (its rows were computed without them). ``defaults``: the value of a grid setting a folder written
    before it existed lacks. A ValueError naming the settings that differ and the fixes."""
    held, wanted = _plain({**(defaults or {}), **held}), _plain(wanted)
    fixed = sorted(k for k in set(held) | set(wanted) if k not in grid and held.get(k) != wanted.get(k))
    clash = []
    for k in grid:
        if not isinstance(wanted.get(k), dict):
            continue
        have, ran = held.get(k) or {}, _members(held, (owners or {}).get(k))
        for m, v in wanted[k].items():
            was = have.get(m, {} if m in ran else None)
            if was is not None and was != v:
                clash.append(f"{k}.{m} differs ({was or 'its defaults'} there, {v} here)")
    if fixed or clash:
        diffs = ", ".join([f"{k}: {held.get(k)!r} there, {wanted.get(k)!r} here" for k in fixed] + clash)
        raise ValueError(
            f"--out {out} holds a {what} with other settings ({diffs}); pass another --out, the same settings to "
            f"resume or extend it (it may grow in {', '.join(grid)}), or --restart to start it again"
        )
    merged = dict(held)
    for k in grid:
        a, b = held.get(k), wanted.get(k)
        if isinstance(b, dict):
            merged[k] = {**(a or {}), **b}
        elif b is not None:
            merged[k] = list(a or []) + [x for x in b if x not in (a or [])]
    return merged


class RowStore:
    """The records of ``out/rows.jsonl`` (see the module docstring).

    ``settings``: this run's; ``grid``: the names among them a later run may extend; ``defaults``: values of grid
    settings missing from an older header; ``owners``: as :func:`merge_settings`. ``restart=True`` starts the file
    again. After opening, ``settings`` is the folder's (the union) and ``records`` every finished cell's record, in
    file order."""

    def __init__(
        self,
        out: str | Path,
        settings: dict,
        grid: Sequence[str] = (),
        restart: bool = False,
        defaults: dict | None = None,
        what: str = "run",
        owners: dict | None = None,
    ):
        self.out = Path(out)
        self.path = self.out / ROWS
        self.out.mkdir(parents=True, exist_ok=True)
        lines = [] if restart else read_jsonl(self.path)
        if lines and "settings" not in lines[0]:
            raise ValueError(f"--out {out}: {self.path} is not a kvjax run's rows file; pass another --out")
        self.settings = (
            merge_settings(lines[0]["settings"], settings, grid, defaults, what, out, owners)
            if lines
            else _plain(settings)
        )
        self.records = lines[1:]
        # rewritten whole: the header may have grown, and the last line of a killed run may be cut short
        self.path.write_text(
            "".join(json.dumps(r) + "\n" for r in [{"settings": self.settings}] + self.records), encoding="utf-8"
        )

    def append(self, record: dict) -> None:
        """Add one finished cell's record (flushed and fsynced before returning)."""
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records.append(_plain(record))


def read_settings(out: str | Path, what: str = "run", command: str = "kvjax-eval") -> dict:
    """The settings line of ``out/rows.jsonl``; a FileNotFoundError naming the command that writes it."""
    path = Path(out) / ROWS
    lines = read_jsonl(path)
    if not lines or "settings" not in lines[0]:
        raise FileNotFoundError(f"--out {out} holds no {what} ({ROWS}); run {command} first")
    return lines[0]["settings"]


def peak_memory() -> dict[str, float]:
    """This process's peak resident memory so far, in GiB (``ru_maxrss``), and the host's total memory."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"peak_rss_gib": peak / 2**30, "host_memory_gib": total / 2**30}
