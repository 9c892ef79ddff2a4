#!/usr/bin/env bash
# issue 33's speed figure, in one run: a small Llama (the llama-small preset: V 8192, d 512,
# 6 layers, 8 heads over 4 kv heads, SwiGLU 1376, 256 positions) trained on 2 ranks by ds-rs
# (`bench train --model DIR`) and by DeepSpeed 0.19.8 training transformers' LlamaForCausalLM from
# the same directory (hf_peer.py), at ZeRO 1 and 3, fp32, micro-batch MB, the programs
# interleaved REPS times (this machine drifts within minutes: only figures of one repetition
# compare). Prints one JSON line per run and the ratio of each pair.
#
#   scripts/bench/llama_vs_peer.sh [REPS] [MB]
#
# Needs the peer environment of ../shared/bench/setup.sh (/opt/peer) and a release build.
set -euo pipefail
reps=${1:-1}
mb=${2:-4}
steps=10
root=$(cd "$(dirname "$0")/../.." && pwd)
peer=${PEER_PYTHON:-/opt/peer/bin/python}
bench=${DS_RS_BENCH:-$root/../shared/bench}
dsrs=$root/target/release/ds-rs
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu
# DeepSpeed builds its CPU ops with the ninja of the peer environment
export PATH="$(dirname "$peer"):$PATH"
# the model directory both start from
cat > "$work/z0.json" <<JSON
{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.0}}}
JSON
"$dsrs" train --config "$work/z0.json" --model llama-small --steps 1 --eval-interval 0 \
    --eval-batches 1 --metrics-dir "$work/init" --save-hf "$work/model" >/dev/null
tokens=$("$peer" -c "import sys; sys.path.insert(0, '$bench'); from make_tokens import ensure_tokens; print(ensure_tokens(8192))")
for rep in $(seq "$reps"); do
    for stage in 1 3; do
        cfg="$work/z$stage.json"
        cat > "$cfg" <<JSON
{"train_micro_batch_size_per_gpu": $mb, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
 "zero_optimization": {"stage": $stage}}
JSON
        ds=$("$peer" -m torch.distributed.run --standalone --nproc_per_node 2 \
            "$root/scripts/bench/hf_peer.py" --model "$work/model" --seq-len 256 \
            --ds-config "$cfg" --tokens "$tokens" --steps $steps 2>/dev/null | grep '^{')
        rs=$("$dsrs" bench train --model "$work/model" --seq-len 256 --config "$cfg" --nproc 2 \
            --warmup 2 --steps $steps --json | grep '^{' | python3 -c "import json, sys; s = json.load(sys.stdin); print(json.dumps(dict(impl='ds-rs', zero_stage=$stage, tokens_per_s=s['tokens_per_s'], step_ms_median=s['step_ms_median'], peak_rss_mib_per_rank=s['peak_rss_mib'])))")
        echo "$ds"
        echo "$rs"
        python3 -c "import json; a = json.loads('''$rs'''); b = json.loads('''$ds'''); print(json.dumps(dict(rep=$rep, zero_stage=$stage, micro_batch=$mb, ratio_tokens_per_s=round(a['tokens_per_s'] / b['tokens_per_s'], 3))))"
    done
done
