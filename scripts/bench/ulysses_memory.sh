#!/usr/bin/env bash
# issue 38's memory table: the Llama-family tiny model (llama-tiny: d 256, 4 layers, 4 query
# and 2 key/value heads, V 4096) trained one step of one sample, fp32, ZeRO-1, at T = 4096,
# 8192 and 16384 positions over sp = 1, 2 and 4 ranks (DeepSpeed-Ulysses), with the MLPs and
# the logits + loss whole and in tiles of TILE positions. Prints one line per run: rank 0's
# peak activation bytes from the memory report (what the tapes hold) and its peak RSS
# (VmHWM), and the ratio of the activations to sp 1's at the same T.
#
#   scripts/bench/ulysses_memory.sh [TILE]
#
# Needs a release build (cargo build --release).
set -euo pipefail
tile=${1:-1024}
root=$(cd "$(dirname "$0")/../.." && pwd)
dsrs=$root/target/release/ds-rs
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/cfg.json" <<JSON
{"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1}}
JSON
printf '%-6s %-3s %-6s %14s %8s %10s\n' T sp tiles activations ratio "RSS MiB"
for t in 4096 8192 16384; do
    for tiled in off on; do
        base=
        for sp in 1 2 4; do
            args="--sp $sp"
            [ "$tiled" = on ] && args="$args --tile $tile"
            dir="$work/t$t-sp$sp-$tiled"
            "$dsrs" launch --nproc_per_node "$sp" --config "$work/cfg.json" train --model llama-tiny \
                --seq-len "$t" --steps 1 $args --eval-interval 0 --eval-batches 1 \
                --metrics-dir "$dir" > "$dir.log" 2>&1 || { tail -3 "$dir.log"; exit 1; }
            read -r act rss < <(python3 -c "
import json; r = json.load(open('$dir/summary.json'))['ranks'][0]
print(r['activations_bytes'], r['peak_rss_mib'])")
            base=${base:-$act}
            ratio=$(python3 -c "print(f'{$base / $act:.2f}')")
            printf '%-6s %-3s %-6s %14s %8s %10s\n' "$t" "$sp" "$tiled" "$act" "$ratio" "$rss"
        done
    done
done
