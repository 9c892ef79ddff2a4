#!/usr/bin/env bash
# issue 38's speed figure: llama-tiny at T positions (default 8192), one sample per step, fp32,
# ZeRO-1, trained by `ds-rs bench train` on sp = 1, 2 and 4 ranks (DeepSpeed-Ulysses; one
# replica, so every run trains the same tokens per step), with DeepSpeed's comms logger on:
# tokens/s of the job, and the all-to-all's share of rank 0's step time (its all_to_all_single
# total latency over all steps, warm-up included, over the sum of those steps' times).
#
#   scripts/bench/ulysses_speed.sh [T] [STEPS]
#
# Needs a release build. On a machine with fewer cores than ranks the ranks share the cores:
# the figure then shows what splitting costs, not what it gains.
set -euo pipefail
t=${1:-8192}
steps=${2:-3}
root=$(cd "$(dirname "$0")/../.." && pwd)
dsrs=$root/target/release/ds-rs
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/cfg.json" <<JSON
{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1},
 "comms_logger": {"enabled": true, "verbose": false, "prof_all": true}}
JSON
for sp in 1 2 4; do
    "$dsrs" bench train --nproc "$sp" --config "$work/cfg.json" --model llama-tiny \
        --seq-len "$t" --sp "$sp" --warmup 1 --steps "$steps" --json > "$work/sp$sp.out" 2> "$work/sp$sp.err" \
        || { tail -5 "$work/sp$sp.err"; exit 1; }
    python3 - "$work/sp$sp.out" "$sp" "$steps" "$t" <<'PY'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
row = next(json.loads(l) for l in lines if l.startswith("{"))
total, in_a2a = 0.0, False
for l in lines:
    if l and not l[0].isspace() and not l.startswith("{"):
        in_a2a = l.startswith("all_to_all")
    elif in_a2a and l.strip():
        total += float(l.split()[-4])  # Total Latency(ms)
steps = 1 + int(sys.argv[3])
step_ms = row["step_ms_median"]
print(json.dumps(dict(sp=int(sys.argv[2]), seq=int(sys.argv[4]), tokens_per_s=round(row["tokens_per_s"], 1),
                      step_ms_median=round(step_ms, 1), all_to_all_ms_per_step=round(total / steps, 1),
                      all_to_all_share=round(total / steps / step_ms, 4),
                      peak_rss_mib=row["peak_rss_mib"])))
PY
done
