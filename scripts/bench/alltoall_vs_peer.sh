#!/usr/bin/env bash
# issue 37's all-to-all benchmark, in one run: 2-rank f32 all_to_all of ds-rs (TCP and shared
# memory; and the MPI backend, which calls MPI_Alltoallv, when the binary has it:
# `cargo build --release --features mpi`) against torch.distributed gloo's all_to_all_single,
# REPS repetitions with the programs interleaved (only figures of one repetition compare).
#
#   scripts/bench/alltoall_vs_peer.sh [REPS] > runs/alltoall.jsonl
#   python3 scripts/bench/alltoall_table.py runs/alltoall.jsonl
#
# Needs the peer environment of ../shared/bench/setup.sh (/opt/peer) and a release build.
set -euo pipefail
reps=${1:-3}
max=${MAX_BYTES:-64M}
root=$(cd "$(dirname "$0")/../.." && pwd)
peer=${PEER_PYTHON:-/opt/peer/bin/python}
dsrs=$root/target/release/ds-rs
export OMP_NUM_THREADS=1
# mpirun refuses root unless told (a benchmark machine's choice, not ds-rs's).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=0
if "$dsrs" bench comm --dist_backend mpi --op all_to_all --min-bytes 1K --max-bytes 1K --json >/dev/null 2>&1; then
    mpi=1
fi
bytes() { numfmt --from=iec "$1"; }
tag() { sed "s/^{/{\"rep\": $1, \"prog\": \"$2\", /"; }
for rep in $(seq "$reps"); do
    "$peer" "$root/scripts/bench/alltoall_gloo_bytes.py" --min-bytes 1024 --max-bytes "$(bytes "$max")" | tag "$rep" gloo
    "$dsrs" bench comm --op all_to_all --nproc 2 --transport tcp --min-bytes 1K --max-bytes "$max" --json | tag "$rep" dsrs_tcp
    "$dsrs" bench comm --op all_to_all --nproc 2 --min-bytes 1K --max-bytes "$max" --json | tag "$rep" dsrs_shm
    if [ "$mpi" = 1 ]; then
        "$dsrs" bench comm --op all_to_all --dist_backend mpi --nproc 2 --min-bytes 1K --max-bytes "$max" --json | tag "$rep" mpi
    fi
done
