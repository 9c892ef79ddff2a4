#!/bin/bash
# DeepSpeed's checkpoints in and out, against DeepSpeed 0.19.8 itself (the peer at /opt/peer,
# ../shared/bench/setup.sh), on the peer's tiny GPT (V 4096, T 128, d 256, H 4, L 4) and token
# stream, 2 ranks, micro-batch 4, AdamW + WarmupLR:
# 1. DeepSpeed trains 5 steps at ZeRO 1, 2, 3 in fp32 and bf16 (and its pipeline engine on 2
#    stages, ZeRO-1 fp32) from gpt.py's initial weights and saves, and trains transformers'
#    Llama of the ds-rs Llama fixture at ZeRO-2 (scripts/bench/hf_peer.py); ds-rs imports each
#    (`checkpoint import-deepspeed`) and trains 5 more steps at dp 2 and at tp 2 x dp 2
#    (`bench train --load-dir`); each loss is set beside DeepSpeed's own 10 straight steps.
# 2. `checkpoint consolidate` of the ZeRO-3 checkpoint against zero_to_fp32.py, tensor by tensor.
# 3. ds-rs trains 5 steps at tp 2 x dp 2 ZeRO-3 and saves; `checkpoint export-universal`;
#    DeepSpeed loads it at dp 2 ZeRO-1 (`"checkpoint": {"load_universal": true}`) and trains 5
#    more; each loss beside ds-rs's own 10 straight steps.
# Usage: scripts/bench/deepspeed_checkpoints.sh [WORKDIR]   (prints a table; ~10 minutes here)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bench=$(cd "$root/../shared/bench" && pwd)
work=${1:-$(mktemp -d)}
mkdir -p "$work"
cd "$root"
cargo build --release -q
dsrs="$root/target/release/ds-rs"
export PATH=/opt/peer/bin:$PATH DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
model="$work/model.json"
echo '{"V": 4096, "T": 128, "d": 256, "H": 4, "L": 4}' > "$model"
config() { # NAME STAGE BF16 [EXTRA JSON]
  python3 - "$work/$1.json" "$2" "$3" "${4:-{\}}" <<'PY'
import json, sys
c = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
     "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
     "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 4}},
     "bf16": {"enabled": sys.argv[3] == "true"}, "zero_optimization": {"stage": int(sys.argv[2])},
     "steps_per_print": 1000000}
c.update(json.loads(sys.argv[4]))
json.dump(c, open(sys.argv[1], "w"), indent=1)
PY
}
peer() { # OUT-TAG ARGS...: train_ds.py on 2 ranks
  local tag=$1; shift
  timeout 900 python -m torch.distributed.run --standalone --nproc_per_node 2 "$bench/train_ds.py" \
    --model "$model" --warmup 0 --tag "$tag" --out "$work/peer.jsonl" "$@" > "$work/$tag.log" 2>&1 \
    || { tail -20 "$work/$tag.log"; exit 1; }
}
ours() { # OUT-TAG ARGS...: bench train (of --model "$model" unless ARGS name one), its losses into ours.jsonl
  local tag=$1; shift
  local which=(--model "$model")
  [[ " $* " == *" --model "* ]] && which=()
  timeout 900 "$dsrs" bench train "${which[@]}" --warmup 0 --json "$@" 2> "$work/$tag.err" \
    | tail -1 | python3 -c 'import json, sys; r = json.load(sys.stdin); print(json.dumps({"tag": sys.argv[1], "losses": r["losses"]}))' "$tag" \
    >> "$work/ours.jsonl" || { tail -20 "$work/$tag.err"; exit 1; }
}
rm -f "$work/peer.jsonl" "$work/ours.jsonl"

echo "== 1. DeepSpeed -> ds-rs"
for case in zero1_fp32:1:false zero2_fp32:2:false zero3_fp32:3:false zero1_bf16:1:true zero2_bf16:2:true zero3_bf16:3:true; do
  IFS=: read -r name stage bf16 <<< "$case"
  config "$name" "$stage" "$bf16"
  rm -rf "$work/$name.ds" "$work/$name.imported"
  peer "$name.save" --ds-config "$work/$name.json" --steps 5 --save-dir "$work/$name.ds"
  peer "$name.straight" --ds-config "$work/$name.json" --steps 10
  "$dsrs" checkpoint import-deepspeed "$work/$name.ds" "$work/$name.imported"
  ours "$name.dp2" --config "$work/$name.json" --nproc 2 --steps 5 --load-dir "$work/$name.imported"
  ours "$name.tp2dp2" --config "$work/$name.json" --nproc 4 --tp 2 --steps 5 --load-dir "$work/$name.imported"
done
# DeepSpeed's pipeline engine: 2 stages, 2 micro-batches of 4 (the samples of dp 2 x 4)
config pipe2_fp32 1 false '{"gradient_accumulation_steps": 2}'
rm -rf "$work/pipe2_fp32.ds" "$work/pipe2_fp32.imported"
pipe() {
  timeout 900 python -m torch.distributed.run --standalone --nproc_per_node 2 "$root/scripts/bench/deepspeed_pipe.py" \
    --model "$model" --ds-config "$work/pipe2_fp32.json" --out "$work/peer.jsonl" "$@" > "$work/pipe.log" 2>&1 \
    || { tail -20 "$work/pipe.log"; exit 1; }
}
pipe --steps 5 --save-dir "$work/pipe2_fp32.ds" --tag pipe2_fp32.save
pipe --steps 10 --tag pipe2_fp32.straight
"$dsrs" checkpoint import-deepspeed "$work/pipe2_fp32.ds" "$work/pipe2_fp32.imported"
ours pipe2_fp32.dp2 --config "$work/zero1_fp32.json" --nproc 2 --steps 5 --load-dir "$work/pipe2_fp32.imported"
ours pipe2_fp32.tp2dp2 --config "$work/zero1_fp32.json" --nproc 4 --tp 2 --steps 5 --load-dir "$work/pipe2_fp32.imported"

# transformers' Llama (the ds-rs Llama fixture's directory), by its Hugging Face names, ZeRO-2
llama="$root/models/tests/fixtures/hf/llama"
tokens=$(python3 -c "import sys; sys.path.insert(0, '$bench'); from make_tokens import ensure_tokens; print(ensure_tokens(64))")
hf() { # OUT-TAG ARGS...: hf_peer.py on 2 ranks
  local tag=$1; shift
  timeout 900 python -m torch.distributed.run --standalone --nproc_per_node 2 "$root/scripts/bench/hf_peer.py" \
    --model "$llama" --seq-len 16 --ds-config "$work/zero2_fp32.json" --tokens "$tokens" --warmup 0 "$@" 2> "$work/$tag.log" \
    | grep '^{' | python3 -c 'import json, sys; r = json.load(sys.stdin); r["tag"] = sys.argv[1]; print(json.dumps(r))' "$tag" \
    >> "$work/peer.jsonl" || { tail -20 "$work/$tag.log"; exit 1; }
}
rm -rf "$work/llama_zero2.ds" "$work/llama_zero2.imported"
hf llama_zero2.save --steps 5 --save-dir "$work/llama_zero2.ds"
hf llama_zero2.straight --steps 10
"$dsrs" checkpoint import-deepspeed "$work/llama_zero2.ds" "$work/llama_zero2.imported"
for layout in dp2:"--nproc 2" tp2dp2:"--nproc 4 --tp 2"; do
  # shellcheck disable=SC2086
  ours "llama_zero2.${layout%%:*}" --model "$llama" --seq-len 16 --config "$work/zero2_fp32.json" ${layout#*:} \
    --steps 5 --load-dir "$work/llama_zero2.imported"
done

echo "== 2. consolidate vs zero_to_fp32.py (ZeRO-3)"
rm -rf "$work/z2f"
python "$work/zero3_fp32.ds/zero_to_fp32.py" "$work/zero3_fp32.ds" "$work/z2f" --safe_serialization > /dev/null 2>&1
"$dsrs" checkpoint consolidate "$work/zero3_fp32.ds" --out "$work/consolidated.safetensors"
python3 - "$work/z2f" "$work/consolidated.safetensors" <<'PY'
import glob, sys, torch
from safetensors.torch import load_file
ref = {}
for f in glob.glob(f"{sys.argv[1]}/*.safetensors"):
    ref.update(load_file(f))
mine = load_file(sys.argv[2])
same = sorted(ref) == sorted(mine) and all(
    ref[k].dtype == mine[k].dtype and torch.equal(ref[k].view(torch.int32), mine[k].view(torch.int32)) for k in ref)
print(f"{len(ref)} tensors, {sum(v.numel() for v in ref.values())} parameters: "
      f"{'bit-identical' if same else 'DIFFERENT'}")
PY

echo "== 3. ds-rs -> DeepSpeed (universal checkpoint)"
config zero3_tp "3" false
config zero1_universal 1 false '{"checkpoint": {"load_universal": true}}'
rm -rf "$work/dsrs.ckpt" "$work/universal"
ours dsrs.straight --config "$work/zero3_tp.json" --nproc 4 --tp 2 --steps 10
ours dsrs.save --config "$work/zero3_tp.json" --nproc 4 --tp 2 --steps 5 --save-dir "$work/dsrs.ckpt"
"$dsrs" checkpoint export-universal "$work/dsrs.ckpt" "$work/universal"
peer universal.resumed --ds-config "$work/zero1_universal.json" --steps 5 --load-dir "$work/universal"

python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
rows = {}
for f in ("peer.jsonl", "ours.jsonl"):
    for line in open(f"{work}/{f}"):
        r = json.loads(line)
        rows[r["tag"]] = r["losses"]
def table(title, want, gots):
    print(f"\n{title}")
    print(f"  {'reference':>34}: " + " ".join(f"{v:.6f}" for v in want))
    for name, got in gots:
        diff = max(abs(a - b) for a, b in zip(got, want))
        print(f"  {name:>34}: " + " ".join(f"{v:.6f}" for v in got) + f"   max |diff| {diff:.1e}")
for case in ("zero1_fp32", "zero2_fp32", "zero3_fp32", "zero1_bf16", "zero2_bf16", "zero3_bf16", "pipe2_fp32",
             "llama_zero2"):
    want = rows[f"{case}.straight"][5:]
    table(f"{case}: DeepSpeed's straight steps 6-10 vs ds-rs resumed from DeepSpeed's step-5 checkpoint",
          want, [(f"ds-rs dp 2", rows[f"{case}.dp2"]), (f"ds-rs tp 2 x dp 2", rows[f"{case}.tp2dp2"])])
table("ds-rs's straight steps 6-10 (tp 2 x dp 2 ZeRO-3) vs DeepSpeed dp 2 ZeRO-1 resumed from ds-rs's universal export",
      rows["dsrs.straight"][5:], [("DeepSpeed dp 2 ZeRO-1", rows["universal.resumed"])])
PY
