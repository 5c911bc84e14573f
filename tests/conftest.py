"""Shared pytest configuration: CPU only, fp32 matmuls, and the ``slow`` marker."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("KVJAX_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or KVJAX_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
