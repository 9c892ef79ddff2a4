#!/usr/bin/env bash
# The test command of README.md (what CI runs): the Python readers the tests compare against,
# every crate's tests, the NCCL backend's build and its GPU test's skip path (no GPU needed),
# and the check that the tests left nothing behind.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/python-env.sh
# The multi-host launcher tests play two hosts with network namespaces (iproute2, root).
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null) || echo "note: iproute2 not installed; the multi-host tests will say they are skipped"
fi
export DS_RS_PYTHON="$PWD/.venv/bin/python"
# Nothing a test starts or makes may outlive it: compared at the end (scripts/leftovers.sh).
before="$(mktemp)"
trap 'rm -f "$before"' EXIT
scripts/leftovers.sh snapshot "$before"
cargo test --workspace --release
# The NCCL backend builds without CUDA; its GPU smoke test says why it skips.
cargo test -p ds-comm --features nccl --release --test nccl_device
scripts/leftovers.sh check "$before"
