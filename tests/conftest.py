"""Shared pytest configuration: CPU only with 8 host devices, fp32 matmuls, the ``slow`` and ``accelerator`` markers.

``JAX_PLATFORMS`` defaults to ``cpu`` (``setdefault``: a value set by the caller wins). The ``accelerator`` tests
(tests/accelerator) are skipped unless the backend is a GPU or TPU, so they run only with the platform named:
``JAX_PLATFORMS=cuda python3 -m pytest tests/accelerator -m accelerator`` (``tpu`` on a TPU).
``KVJAX_ACCELERATOR_DRY_RUN=1`` runs them on CPU instead, the kernels in interpret mode (checks the test code).

XLA splits the host CPU into 8 devices (``--xla_force_host_platform_device_count=8``, set before jax starts) so
the sharding tests (``tests/sharding``) run meshes of up to 8 devices in this process; everything else runs on
device 0 as before (measured: no slowdown of tests/kvjax/test_engine.py).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


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
    if config.getoption("--runslow") or os.environ.get("KVJAX_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or KVJAX_SLOW=1")
    for item in items:
        if item.get_closest_marker("slow"):
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
