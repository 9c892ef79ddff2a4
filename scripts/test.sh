#!/usr/bin/env bash
# The test command of README.md (what CI runs): the Python readers the tests compare against,
# every crate's tests, the NCCL backend's build and its GPU test's skip path (no GPU needed),
# the MPI backend's tests (OpenMPI installed by scripts/install-mpi.sh), and the check that the
# tests left nothing behind.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage's wall time, and the slowest test binaries, printed at the end (scripts/stages.sh).
source scripts/stages.sh
stage "python readers (.venv)" scripts/python-env.sh
# The multi-host launcher tests play two hosts with network namespaces (iproute2, root).
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null) || echo "note: iproute2 not installed; the multi-host tests will say they are skipped"
fi
export DS_RS_PYTHON="$PWD/.venv/bin/python"
# Nothing a test starts or makes may outlive it: compared at the end (scripts/leftovers.sh).
before="$(mktemp)"
trap 'rm -f "$before" "$stages_log" "$tests_log"' EXIT
scripts/leftovers.sh snapshot "$before"
# The crates as floors: no dependency (dev-dependencies included) from a lower floor to a
# higher; and no circle of imports between files of different modules.
python3 scripts/floors.py >/dev/null
python3 scripts/import-cycles.py
stage "build and link the tests (release)" cargo test --workspace --release --no-run
stage_tests "run the tests" cargo test --workspace --release
# The NCCL backend builds without CUDA; its GPU smoke test says why it skips.
# (--workspace keeps the first command's feature resolution: only ds-comm and its dependents
# build again, not candle and the rest.)
stage "NCCL backend: build, GPU test's skip path" \
    cargo test --workspace --release --features ds-comm/nccl --test nccl_device
# The MPI backend (feature mpi): the collective matrix under mpirun -np 2 and 4, and training
# over MPI against the built-in transport, on one host and on two netns hosts.
if stage "install OpenMPI" scripts/install-mpi.sh; then
    stage "MPI backend: build and tests" \
        cargo test --workspace --release --features ds-rs/mpi,ds-comm/mpi --test mpi_collectives --test mpi_train
else
    echo "note: OpenMPI is not installed; the MPI backend's tests are skipped"
fi
scripts/leftovers.sh check "$before"
stages_report
