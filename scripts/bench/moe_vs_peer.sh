#!/usr/bin/env bash
# issue 37's speed figure, in one run: the mixtral-tiny preset (8 experts of width 344, top-2,
# d 256, 4 layers, V 4096, 128 positions) trained on 2 ranks at ZeRO 2, fp32, micro-batch MB:
# by ds-rs at ep 1 (dp 2) and ep 2 (`bench train --model DIR [--ep 2]`) and by DeepSpeed 0.19.8
# training transformers' MixtralForCausalLM from the same directory (hf_peer.py) at dp 2. The
# programs run interleaved REPS times (this machine drifts within minutes: only figures of one
# repetition compare). Prints one JSON line per run and the ratios against DeepSpeed.
#
# DeepSpeed's own expert parallelism (AutoEP, `expert_parallel`) does not run with the peer's
# transformers 5.24 (its output-recorder hook calls a registry method transformers changed), so
# the peer trains the same model without it.
#
#   scripts/bench/moe_vs_peer.sh [REPS] [MB]
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
export PATH="$(dirname "$peer"):$PATH"
cat > "$work/z0.json" <<JSON
{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.0}}}
JSON
"$dsrs" train --config "$work/z0.json" --model mixtral-tiny --steps 1 --eval-interval 0 \
    --eval-batches 1 --metrics-dir "$work/init" --save-hf "$work/model" >/dev/null
tokens=$("$peer" -c "import sys; sys.path.insert(0, '$bench'); from make_tokens import ensure_tokens; print(ensure_tokens(4096))")
cfg="$work/z2.json"
cat > "$cfg" <<JSON
{"train_micro_batch_size_per_gpu": $mb, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
 "zero_optimization": {"stage": 2}}
JSON
for rep in $(seq "$reps"); do
    ds=$("$peer" -m torch.distributed.run --standalone --nproc_per_node 2 \
        "$root/scripts/bench/hf_peer.py" --model "$work/model" --seq-len 128 \
        --ds-config "$cfg" --tokens "$tokens" --steps $steps 2>/dev/null | grep '^{')
    echo "$ds"
    for ep in 1 2; do
        rs=$("$dsrs" bench train --model "$work/model" --seq-len 128 --config "$cfg" --nproc 2 \
            --ep $ep --warmup 2 --steps $steps --json | grep '^{' | python3 -c "import json, sys; s = json.load(sys.stdin); print(json.dumps(dict(impl='ds-rs', ep=$ep, tokens_per_s=s['tokens_per_s'], step_ms_median=s['step_ms_median'], peak_rss_mib_per_rank=s['peak_rss_mib'])))")
        echo "$rs"
        python3 -c "import json; a = json.loads('''$rs'''); b = json.loads('''$ds'''); print(json.dumps(dict(rep=$rep, ep=$ep, micro_batch=$mb, ratio_tokens_per_s=round(a['tokens_per_s'] / b['tokens_per_s'], 3))))"
    done
done
