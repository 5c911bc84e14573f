"""Shared pytest configuration: CPU only with 8 host devices, fp32 matmuls, the ``slow`` and ``accelerator`` markers.

``JAX_PLATFORMS`` defaults to ``cpu`` (``setdefault``: a value set by the caller wins). The ``accelerator`` tests
(tests/accelerator) are skipped unless the backend is a GPU or TPU, so they run only with the platform named:
``JAX_PLATFORMS=cuda python3 -m pytest tests/accelerator -m accelerator`` (``tpu`` on a TPU).
``KVJAX_ACCELERATOR_DRY_RUN=1`` runs them on CPU instead, the kernels in interpret mode (checks the test code).

XLA splits the host CPU into 8 devices (``--xla_force_host_platform_device_count=8``, set before jax starts) so
the sharding tests (``tests/sharding``) run meshes of up to 8 devices in this process; everything else runs on
device 0 as before (measured: no slowdown of tests/kvjax/test_engine.py).

The tests compile XLA's CPU code without LLVM's optimisations (``--xla_backend_optimization_level=0
--xla_llvm_disable_expensive_passes=true`` added to ``XLA_FLAGS`` unless it names an optimisation level;
``KVJAX_TEST_FAST_COMPILE=0`` keeps the default): the programs are tiny and compile time dominates (measured: the
bucket-invariance tests of four methods 101 s -> 56 s on 2 cores). The HLO the tests read is the same; only the
machine code is less optimised. Benchmarks and users' runs keep XLA's defaults.

The suite shares JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``, default
``$TMPDIR/kvjax-test-jax-cache``; ``KVJAX_TEST_COMPILE_CACHE=0`` turns it off, another value names the folder): the
tests build the same tiny models and methods in many modules, both xdist workers and the command-line tests'
subprocesses, and each module drops its compiled programs (``_free_compiled_programs``), so without the cache the
same program is compiled again and again. Set in the environment, so subprocesses share it. The cache is keyed by
the program and the jax/XLA versions, so a changed program always compiles anew; docs/testing.md gives the suite's
time with an empty cache, as on a clean CI machine.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
if (
    os.environ.get("KVJAX_TEST_FAST_COMPILE", "1") != "0"
    and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]
):
    # the tests' programs are tiny and compiled once: LLVM's optimisation costs more than it saves (module docstring)
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_cache = os.environ.get("KVJAX_TEST_COMPILE_CACHE", "")
if _cache != "0":
    import tempfile

    os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR", _cache or os.path.join(tempfile.gettempdir(), "kvjax-test-jax-cache")
    )
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")  # the tests' programs are small
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))  # least recently used beyond 4 GiB

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")
    parser.addoption(
        "--extended", action="store_true", default=False, help="run tests marked extended (CI's second line)"
    )


def pytest_collection_modifyitems(config, items):
    # markers, not ``item.keywords``: keywords also hold the names of the parent folders (tests/accelerator)
    accelerator = [item for item in items if item.get_closest_marker("accelerator")]
    dry_run = os.environ.get("KVJAX_ACCELERATOR_DRY_RUN") == "1"
    if accelerator and jax.default_backend() not in ("gpu", "tpu") and not dry_run:
        skip = pytest.mark.skip(
            reason=f"accelerator: needs a GPU or TPU backend, not {jax.default_backend()}; run "
            "JAX_PLATFORMS=cuda (or tpu) python3 -m pytest tests/accelerator -m accelerator"
        )
        for item in accelerator:
            item.add_marker(skip)
    runslow = config.getoption("--runslow") or os.environ.get("KVJAX_SLOW") == "1"
    extended = runslow or config.getoption("--extended") or os.environ.get("KVJAX_EXTENDED") == "1"
    for marker, run, how in (
        ("slow", runslow, "--runslow or KVJAX_SLOW=1"),
        ("extended", extended, "--extended or KVJAX_EXTENDED=1 (.ci/run does)"),
    ):
        if run:
            continue
        skip = pytest.mark.skip(reason=f"{marker}: run with {how}")
        for item in items:
            if item.get_closest_marker(marker):
                item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop JAX's compiled executables after every test module. One pytest process compiles thousands of
    programs; each CPU executable keeps its own memory mappings, and without this the suite approached the
    kernel's ``vm.max_map_count`` (65530) and XLA's compiler crashed late in the run (a segfault in a clean
    CI clone, never in a single file)."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def tiny(request):
    """The tiny random model of tests/tiny_models.py, built once per test module. A module that needs other sizes,
    weights or a seed names them in a marker, ``pytestmark = pytest.mark.tiny(num_layers=3, seed=3)``: the
    marker's keywords go to :func:`tiny_models.tiny_model` (``ModelConfig`` fields, ``seed``, ``scale``, ``dtype``);
    without one the module gets ``tiny_model()``. A module that defines its own ``tiny`` fixture uses that."""
    from tiny_models import tiny_model

    marker = request.node.get_closest_marker("tiny")
    return tiny_model(**(marker.kwargs if marker else {}))
