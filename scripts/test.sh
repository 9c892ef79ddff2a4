#!/usr/bin/env bash
# The test command of README.md (what CI runs): the Python readers the tests compare against,
# every crate's tests, and the NCCL backend's build check (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/python-env.sh
export DS_RS_PYTHON="$PWD/.venv/bin/python"
cargo test --workspace --release
cargo check -p ds-comm --features nccl --release
