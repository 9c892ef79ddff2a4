#!/usr/bin/env bash
# issue 37's DeepSpeed-MoE speed figure, in one run: the gpt-moe-tiny preset (the peer's tiny
# GPT, d 256, 4 blocks, V 4096, 128 positions, whose 2nd and 4th blocks hold 8 experts with
# top-1 gating, capacity factor 1, at least 4 slots, dropping, 0.01 l_aux) trained on 2 ranks
# at ZeRO 2, fp32, micro-batch MB, at ep 1 and ep 2: by ds-rs (`bench train --model JSON
# --ep N`) and by DeepSpeed 0.19.8 with `deepspeed.moe.layer.MoE` in the same blocks
# (gpt_moe_peer.py, ep_size N), on the peer benchmark's tokens. The programs run interleaved
# REPS times (this machine drifts within minutes: only figures of one repetition compare).
# Prints one JSON line per run and the ratios against DeepSpeed.
#
#   scripts/bench/gpt_moe_vs_peer.sh [REPS] [MB]
#
# Needs the peer environment of ../shared/bench/setup.sh (/opt/peer) and a release build.
set -euo pipefail
reps=${1:-1}
mb=${2:-4}
steps=10
root=$(cd "$(dirname "$0")/../.." && pwd)
peer=${PEER_PYTHON:-/opt/peer/bin/python}
export DS_RS_BENCH=${DS_RS_BENCH:-$root/../shared/bench}
dsrs=$root/target/release/ds-rs
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu
export PATH="$(dirname "$peer"):$PATH"
# the gpt-moe-tiny preset as a model JSON, which both read
cat > "$work/model.json" <<JSON
{"V": 4096, "T": 128, "d": 256, "H": 4, "L": 4,
 "moe": {"num_experts": 8, "k": 1, "capacity_factor": 1.0, "min_capacity": 4, "drop_tokens": true,
         "aux_loss_coef": 0.01, "expert_interval": 2}}
JSON
cfg="$work/z2.json"
cat > "$cfg" <<JSON
{"train_micro_batch_size_per_gpu": $mb, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
 "zero_optimization": {"stage": 2}}
JSON
for rep in $(seq "$reps"); do
    for ep in 1 2; do
        ds=$("$peer" -m torch.distributed.run --standalone --nproc_per_node 2 \
            "$root/scripts/bench/gpt_moe_peer.py" --model "$work/model.json" --ep $ep \
            --ds-config "$cfg" --warmup 2 --steps $steps 2>/dev/null | grep '^{')
        echo "$ds"
        rs=$("$dsrs" bench train --model "$work/model.json" --config "$cfg" --nproc 2 \
            --ep $ep --warmup 2 --steps $steps --json | grep '^{' | python3 -c "import json, sys; s = json.load(sys.stdin); print(json.dumps(dict(impl='ds-rs', ep=$ep, tokens_per_s=s['tokens_per_s'], step_ms_median=s['step_ms_median'], peak_rss_mib_per_rank=s['peak_rss_mib'])))")
        echo "$rs"
        python3 -c "import json; a = json.loads('''$rs'''); b = json.loads('''$ds'''); print(json.dumps(dict(rep=$rep, ep=$ep, micro_batch=$mb, ratio_tokens_per_s=round(a['tokens_per_s'] / b['tokens_per_s'], 3))))"
    done
done
