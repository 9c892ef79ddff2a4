#!/usr/bin/env bash
# Run the peer baselines. Usage (from anywhere):
#   bash scripts/bench/peer/run_all.sh [what...]
# what: micro (allreduce + memcpy + adam), train-tiny, train-small, or all (default).
# KINDS / STAGES select training runs (see below).
# REPS (default 2) repetitions of each measurement; results are appended as JSON lines to
# scripts/bench/peer/results/*.jsonl and full logs go to scripts/bench/peer/results/logs/.
# Nothing else should run on the machine meanwhile (2 cores); bench_guard.py waits for an idle
# machine before each run and records in results/guard.jsonl how much foreign CPU load there was.
set -euo pipefail
cd "$(dirname "$0")"
# venv location: PEER_VENV, else the default written in setup.sh (VENV=${PEER_VENV:-...} there)
VENV=${PEER_VENV:-$(sed -n 's/^VENV=${PEER_VENV:-\(.*\)}$/\1/p' setup.sh)}
export PATH="$VENV/bin:$PATH" DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
REPS=${REPS:-2}
REP0=${REP0:-1}   # number of the first repetition (tags rep$REP0 ...)
MAX_WAIT=${MAX_WAIT:-30}   # seconds to wait for an idle machine before each run (see bench_guard.py)
# Own rendezvous ports, away from the defaults (29500) that other jobs may be using.
DS_PORT=${DS_PORT:-29731}
KINDS=${KINDS:-single ddp ds ds-torchrun}   # which training runs (subset to re-run some)
STAGES=${STAGES:-0 1 2 3}
mkdir -p results/logs
WHAT=("$@"); [ ${#WHAT[@]} -eq 0 ] && WHAT=(all)

log() { echo "[$(date +%H:%M:%S)] $*"; }
run() {  # run NAME CMD...: log to results/logs/NAME.log, show the JSON summary lines
    local name=$1; shift
    log "$name: $*"
    local t0=$SECONDS
    if python bench_guard.py --name "$name" --jsonl results/guard.jsonl --max-wait "$MAX_WAIT" -- "$@" \
            > "results/logs/$name.log" 2>&1; then
        grep -E '^(\{|GUARD)' "results/logs/$name.log" | cut -c1-400 || true
    else
        echo "FAILED ($name), see results/logs/$name.log"; tail -5 "results/logs/$name.log"
    fi
    log "$name took $((SECONDS - t0)) s"
}

micro() {
    for rep in $(seq "$REP0" $((REP0 + REPS - 1))); do
        run "allreduce_rep$rep" python allreduce_gloo.py --out results/allreduce.jsonl --tag "rep$rep"
        for th in 1 2; do
            run "adam_t${th}_rep$rep" python adam_cpu.py --threads "$th" --out results/adam.jsonl --tag "rep$rep"
        done
    done
}

want() { [[ " $KINDS " == *" $1 "* ]]; }

train() {
    local p=$1
    for rep in $(seq "$REP0" $((REP0 + REPS - 1))); do
        if want single; then
            for th in 2 1; do
                run "${p}_single_t${th}_rep$rep" env OMP_NUM_THREADS=$th \
                    python train_torch.py --preset "$p" --out results/train.jsonl --tag "rep$rep"
            done
        fi
        if want ddp; then
            run "${p}_ddp_rep$rep" env OMP_NUM_THREADS=1 \
                torchrun --standalone --nproc_per_node 2 train_torch.py --preset "$p" --out results/train.jsonl --tag "rep$rep"
        fi
        if want ds; then
            for z in $STAGES; do
                run "${p}_ds_zero${z}_rep$rep" env OMP_NUM_THREADS=1 \
                    deepspeed --num_gpus 2 --master_port "$DS_PORT" train_ds.py --preset "$p" --ds-config "configs/zero$z.json" \
                    --out results/train.jsonl --tag "rep$rep"
            done
        fi
        if want ds-torchrun; then
            # the same DeepSpeed script under torchrun instead of the deepspeed launcher
            run "${p}_ds_zero2_torchrun_rep$rep" env OMP_NUM_THREADS=1 \
                torchrun --standalone --nproc_per_node 2 train_ds.py --preset "$p" --ds-config configs/zero2.json \
                --out results/train.jsonl --tag "torchrun-rep$rep"
        fi
    done
}

for w in "${WHAT[@]}"; do
    case $w in
        micro) micro ;;
        train-tiny) train tiny ;;
        train-small) train small ;;
        all) micro; train tiny; train small ;;
        *) echo "unknown: $w"; exit 2 ;;
    esac
done
log done
