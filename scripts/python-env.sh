#!/usr/bin/env bash
# Creates .venv, the Python that the tests use as an independent reader of ds-rs's outputs
# (TensorBoard's own event-file reader), from scripts/requirements.txt. Idempotent: a .venv
# that already has the pinned packages is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && cmp -s scripts/requirements.txt .venv/requirements.txt; then
    exit 0
fi
rm -rf .venv
"$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r scripts/requirements.txt
cp scripts/requirements.txt .venv/requirements.txt
