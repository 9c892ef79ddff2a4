#!/usr/bin/env bash
# issue 3's comm benchmark, in one run: 2-rank f32 all_reduce of ds-rs (TCP and shared
# memory; and the MPI backend when the binary has it: `cargo build --release --features mpi`)
# against torch.distributed gloo, memcpy and the shared-memory bound, repeated
# REPS times with the programs interleaved (this machine drifts by tens of percent within
# minutes, so only figures from the same repetition compare).
#
#   scripts/bench/comm_vs_peer.sh [REPS] > runs/comm.jsonl; python3 scripts/bench/comm_table.py runs/comm.jsonl
#
# Needs the peer environment of ../shared/bench/setup.sh (/opt/peer) and a release build.
set -euo pipefail
reps=${1:-3}
root=$(cd "$(dirname "$0")/../.." && pwd)
peer=${PEER_PYTHON:-/opt/peer/bin/python}
bench=${DS_RS_BENCH:-$root/../shared/bench}
dsrs=$root/target/release/ds-rs
bound=$(mktemp)
trap 'rm -f "$bound"' EXIT
gcc -O3 -march=native -o "$bound" "$root/scripts/bench/shm_allreduce_bound.c"
export OMP_NUM_THREADS=1
# mpirun refuses root unless told (a benchmark machine's choice, not ds-rs's).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=0
if "$dsrs" bench comm --dist_backend mpi --min-bytes 1K --max-bytes 1K --json >/dev/null 2>&1; then
    mpi=1
fi
tag() { sed "s/^{/{\"rep\": $1, \"prog\": \"$2\", /"; }
for rep in $(seq "$reps"); do
    (cd "$bench" && "$peer" allreduce_gloo.py --sizes-mib 64 256) | tag "$rep" gloo_mib
    "$peer" "$root/scripts/bench/allreduce_gloo_bytes.py" --min-bytes 1024 --max-bytes $((128 << 20)) | tag "$rep" gloo_bytes
    "$dsrs" bench comm --nproc 2 --transport tcp --min-bytes 1K --max-bytes 256M --json | tag "$rep" dsrs_tcp
    "$dsrs" bench comm --nproc 2 --min-bytes 1K --max-bytes 256M --json | tag "$rep" dsrs_shm
    if [ "$mpi" = 1 ]; then
        "$dsrs" bench comm --dist_backend mpi --nproc 2 --min-bytes 1K --max-bytes 256M --json | tag "$rep" dsrs_mpi
    fi
    "$bound" | tag "$rep" bound
done
