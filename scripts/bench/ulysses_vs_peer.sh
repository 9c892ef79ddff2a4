#!/usr/bin/env bash
# issue 38's comparison with DeepSpeed-Ulysses: the peer benchmark's GPT (V 4096, d 256, 4 heads,
# 4 blocks) at T positions, from the same initial weights (gpt.py's, seed 0) and the same
# batches of the peer benchmark's tokens, trained STEPS steps in fp32 with AdamW on 2 ranks at
# sequence-parallel size 2: by DeepSpeed 0.19.8 (ulysses_peer.py: DistributedAttention over
# parallel_state_sp's groups, gloo) and by ds-rs (`train --sp 2`), and by ds-rs in one
# process. Prints each run's losses and the largest relative difference to DeepSpeed's.
#
#   scripts/bench/ulysses_vs_peer.sh [T] [STEPS]
#
# Needs the peer environment of ../shared/bench/setup.sh (/opt/peer) and a release build.
set -euo pipefail
t=${1:-512}
steps=${2:-5}
root=$(cd "$(dirname "$0")/../.." && pwd)
peer=${PEER_PYTHON:-/opt/peer/bin/python}
export DS_RS_BENCH=${DS_RS_BENCH:-$root/../shared/bench}
dsrs=$root/target/release/ds-rs
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu
export PATH="$(dirname "$peer"):$PATH"
echo "{\"V\": 4096, \"T\": $t, \"d\": 256, \"H\": 4, \"L\": 4}" > "$work/model.json"
cat > "$work/sp2.json" <<JSON
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "sequence_parallel_size": 2,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
 "zero_optimization": {"stage": 0}}
JSON
sed "s/ \"sequence_parallel_size\": 2,//" "$work/sp2.json" > "$work/sp1.json"
"$peer" - "$work/model.json" "$work/init.safetensors" <<'PY'
import json, sys
sys.path.insert(0, __import__("os").environ["DS_RS_BENCH"])
import gpt
cfg = {k: int(v) for k, v in json.load(open(sys.argv[1])).items()}
gpt.save_init(gpt.build_model(cfg, seed=0), sys.argv[2])
PY
ds=$("$peer" -m torch.distributed.run --standalone --nproc_per_node 2 "$root/scripts/bench/ulysses_peer.py" \
    --model "$work/model.json" --init "$work/init.safetensors" --ds-config "$work/sp2.json" \
    --steps "$steps" 2>"$work/peer.log" | tail -1) || { tail -20 "$work/peer.log"; exit 1; }
echo "$ds"
losses() { python3 -c "
import json; print(json.dumps([json.loads(l)['loss'] for l in open('$1/metrics.jsonl') if '\"loss\"' in l]))"; }
for n in 2 1; do
    "$dsrs" launch --nproc_per_node "$n" --config "$work/sp$n.json" train --model "$work/model.json" \
        --init "$work/init.safetensors" --data uniform --no-shuffle --sp "$n" --steps "$steps" \
        --eval-interval 0 --eval-batches 1 --metrics-dir "$work/m$n" > "$work/dsrs$n.log" 2>&1 \
        || { tail -5 "$work/dsrs$n.log"; exit 1; }
    python3 -c "
import json, sys
ds = json.loads(sys.argv[1])['losses']; got = json.loads(sys.argv[2])
worst = max(abs(g - w) / abs(w) for g, w in zip(got, ds))
print(json.dumps(dict(impl='ds-rs', sp=$n, nproc=$n, losses=got, largest_relative_difference_to_deepspeed=worst)))
" "$ds" "$(losses "$work/m$n")"
done
