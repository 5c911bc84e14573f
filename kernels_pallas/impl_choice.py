"""How a kernel's ``impl=None`` is resolved: only what has run.

1. The kernel's environment variable (:data:`ENV_VARS`, e.g. ``KVJAX_DECODE_ATTENTION_IMPL=pallas_gpu``) names
   an implementation: it is used, verified or not (as an explicit ``impl=`` is).
2. Else, unless :data:`SLOWER_THAN_XLA` records the kernel as measured slower than the XLA path on that backend,
   the backend's platform kernel (:data:`PLATFORM_IMPLS`: ``pallas_tpu`` / ``pallas_gpu``, for prefill
   ``splash`` / ``cudnn``) is used **only if it has been verified** on that backend: compiled on the hardware and
   checked against its reference by ``bash scripts/accelerator.sh tests``, which writes the record
   :data:`VERIFIED_FILE` (``kernels_pallas/verified.py``: per kernel and backend, the implementation, the
   device kind, the jax version, the date and the tests that passed; a module, so installs carry it).
   ``KVJAX_UNVERIFIED_KERNELS=1`` takes every platform kernel without a record.
3. Else the XLA path (``xla``, for prefill ``chunked``), and a warning, once per kernel and backend, naming the
   kernel and the variable that opts in.

``python3 -m kernels_pallas.impl_choice`` prints the table; ``python3 -m kernels_pallas.impl_choice record
JUNIT.xml`` updates it from a run of ``tests/accelerator`` (:func:`record_from_junit`).
"""

from __future__ import annotations

import datetime
import logging
import os
import pprint
import sys
from pathlib import Path

import jax

log = logging.getLogger("kvjax.kernels")

VERIFIED_FILE = Path(__file__).with_name("verified.py")
#: Set to 1: ``impl=None`` takes every platform kernel, verified or not.
ALL_ENV = "KVJAX_UNVERIFIED_KERNELS"
#: kernel -> backend -> the platform implementation ``impl=None`` takes there once verified.
PLATFORM_IMPLS = {
    "decode_attention": {"tpu": "pallas_tpu", "gpu": "pallas_gpu"},
    "pq_lookup": {"tpu": "pallas_tpu", "gpu": "pallas_gpu"},
    "cosine_kmeans": {"tpu": "pallas_tpu", "gpu": "pallas_gpu"},
    "chunked_similarity": {"tpu": "pallas_tpu", "gpu": "pallas_gpu"},
    "accumulated_attention": {"gpu": "pallas_gpu"},  # no TPU kernel: a TPU runs the XLA path
    "prefill_attention": {"tpu": "splash", "gpu": "cudnn"},
}
#: kernel -> backend -> why ``impl=None`` takes the XLA path there although the platform kernel is verified: the
#: kernel was measured slower than the XLA path in the same setting (a verified kernel is correct, not necessarily
#: fast). Only the kernel's environment variable or an explicit ``impl=`` then takes the kernel
#: (``KVJAX_UNVERIFIED_KERNELS=1`` does not).
SLOWER_THAN_XLA = {
    "cosine_kmeans": {
        "gpu": "H200, 32k tokens x batch 8, bf16, one layer's device time (profile_h200_32k_b8*.txt, 2026-11-27): "
        "ClusterKV's prefill 5,731 ms with the Triton kernels (cosine_assign_gpu 244 ms a call), 346 ms with the "
        "XLA path; TTFT over two layers 11.73 s -> 0.95 s (full 0.25 s)",
    },
    "pq_lookup": {
        "gpu": "H200, 32k x 8, bf16, one layer's decode step (device time): PQCache@0.2 1.676 ms with the Triton "
        "lookup (1.13 ms of it), 0.361 ms on the XLA path (its code-tuple table); @2048 1.642 -> 0.239 ms",
    },
    "chunked_similarity": {
        "gpu": "H200, 32k x 8, bf16, one layer's prefill (device time): Chelsea@0.2 169.8 ms with the Triton "
        "chunk_best_match (158 ms of it), 16.9 ms on the XLA path",
    },
}


#: kernel -> the environment variable that forces an implementation.
ENV_VARS = {name: f"KVJAX_{name.upper()}_IMPL" for name in PLATFORM_IMPLS}
#: kernel -> the tests of ``tests/accelerator`` that verify it (``file::name`` prefixes of the junit test ids).
VERIFYING_TESTS = {
    "decode_attention": ("test_kernels.py::test_decode_attention_",),
    "pq_lookup": ("test_kernels.py::test_pq_lookup_",),
    "cosine_kmeans": ("test_kernels.py::test_cosine_kmeans_",),
    "chunked_similarity": ("test_kernels.py::test_chunked_similarity_",),
    "accumulated_attention": ("test_kernels.py::test_accumulated_attention_",),
    "prefill_attention": ("test_prefill.py::test_platform_impl_matches_chunked",),
}
_warned: set[tuple[str, str]] = set()


def env_impl(var: str, impls: tuple[str, ...]) -> str | None:
    """The implementation named by the environment variable ``var`` (None when unset or empty); a name not in
    ``impls`` is a ValueError naming the variable, its value and the allowed names."""
    env = os.environ.get(var)
    if not env:
        return None
    if env not in impls:
        raise ValueError(f"{var}={env!r} must be one of {impls} (or unset to choose by backend)")
    return env


def backend() -> str:
    """The backend ``impl=None`` chooses for (``jax.default_backend()``; tests replace this function)."""
    return jax.default_backend()


def load_verified() -> dict:
    """The record: ``{kernel: {backend: None | {"impl", "device_kind", "jax", "date", "tests"}}}``."""
    from kernels_pallas.verified import VERIFIED

    return VERIFIED


def verified(kernel: str, on: str) -> dict | None:
    """The record of ``kernel`` verified on backend ``on`` (None: never verified there)."""
    entry = load_verified().get(kernel, {}).get(on)
    return entry if entry and entry.get("impl") == PLATFORM_IMPLS[kernel].get(on) else None


def choose(kernel: str, impls: tuple[str, ...], fallback: str) -> str:
    """``impl=None`` of ``kernel`` (module docstring): the environment variable, else the verified platform
    kernel, else ``fallback`` (the XLA path) with a warning once."""
    forced = env_impl(ENV_VARS[kernel], impls)
    if forced:
        return forced
    on = backend()
    platform = PLATFORM_IMPLS[kernel].get(on)
    if platform is None or on in SLOWER_THAN_XLA.get(kernel, {}):
        return fallback
    if os.environ.get(ALL_ENV) == "1" or verified(kernel, on) is not None:
        return platform
    if (kernel, on) not in _warned:
        _warned.add((kernel, on))
        log.warning(
            "kvjax: the %s kernel %r has not been verified on %s (kernels_pallas/verified.py); using %r. "
            "Opt in with %s=%s (or %s=1 for every kernel); bash scripts/accelerator.sh tests verifies and "
            "records it.",
            kernel,
            platform,
            on,
            fallback,
            ENV_VARS[kernel],
            platform,
            ALL_ENV,
        )
    return fallback


def record_from_junit(
    junit_xml, path: Path | None = None, device_kind: str | None = None, on: str | None = None
) -> dict:
    """Update the record (``path``, default :data:`VERIFIED_FILE`) from a ``tests/accelerator`` junit file.

    On this backend (``on``), a kernel whose verifying tests (:data:`VERIFYING_TESTS`) all passed (at least one
    ran; none failed, errored or was skipped) is recorded with the device kind, jax version and today's date; one
    with a failure is reset to unverified; one whose tests did not run is left as it was. Returns the new record
    (also written to ``path``)."""
    import xml.etree.ElementTree as ET

    path = Path(path or VERIFIED_FILE)
    on = on or backend()
    if on not in ("gpu", "tpu"):
        raise ValueError(
            f"record_from_junit: the backend is {on!r}; only a GPU or TPU run verifies a kernel "
            "(run bash scripts/accelerator.sh tests on the device)"
        )
    device_kind = device_kind or jax.devices()[0].device_kind
    outcomes: dict[str, list[str]] = {k: [] for k in PLATFORM_IMPLS}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        test_id = case.get("classname", "").rsplit(".", 1)[-1] + ".py::" + case.get("name", "")
        status = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        for kernel, prefixes in VERIFYING_TESTS.items():
            if test_id.startswith(prefixes):
                outcomes[kernel].append(status)
    record = _read(path)
    for kernel, statuses in outcomes.items():
        if not statuses or on not in PLATFORM_IMPLS[kernel]:  # no kernel for this backend: nothing to record
            continue
        ok = all(s == "passed" for s in statuses)
        record.setdefault(kernel, {})[on] = (
            {
                "impl": PLATFORM_IMPLS[kernel][on],
                "device_kind": device_kind,
                "jax": jax.__version__,
                "date": datetime.date.today().isoformat(),
                "tests": f"{statuses.count('passed')}/{len(statuses)} passed",
            }
            if ok
            else None
        )
    text = path.read_text()
    path.write_text(
        text[: text.index("VERIFIED = ")] + "VERIFIED = " + pprint.pformat(record, width=116, sort_dicts=False) + "\n"
    )
    return record


def _read(path: Path) -> dict:
    """The ``VERIFIED`` dict of a record file (a Python literal after ``VERIFIED = ``)."""
    import ast

    text = path.read_text()
    return ast.literal_eval(text[text.index("VERIFIED = ") + len("VERIFIED = ") :])


def table(record: dict | None = None) -> str:
    """The record as a markdown table (kernel x backend)."""
    record = load_verified() if record is None else record
    rows = ["| kernel | GPU | TPU |", "|---|---|---|"]
    for kernel, by in PLATFORM_IMPLS.items():
        cells = []
        for on in ("gpu", "tpu"):
            e = record.get(kernel, {}).get(on)
            if on not in by:
                cells.append("no kernel (XLA path)")
                continue
            cells.append(
                f"`{by[on]}`: "
                + (f"verified {e['date']} on {e['device_kind']}, jax {e['jax']}" if e else "not verified (XLA path)")
                + (
                    "; slower than the XLA path, which `impl=None` takes"
                    if on in SLOWER_THAN_XLA.get(kernel, {})
                    else ""
                )
            )
        rows.append(f"| {kernel} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"] and len(sys.argv) == 3:
        record_from_junit(sys.argv[2])
        print(table())
    elif len(sys.argv) == 1:
        print(table())
    else:
        sys.exit("usage: python3 -m kernels_pallas.impl_choice [record JUNIT.xml]")
