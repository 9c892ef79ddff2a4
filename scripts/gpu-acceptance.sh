#!/usr/bin/env bash
# The one command for a GPU host (issue 22 Part B): runs every device check that exists so far
# and prints a table of check, result, figure. Checks whose inputs are missing are reported as
# "skip" with the reason, so the table always says what is still to be measured.
#
#   scripts/gpu-acceptance.sh [--bundle DIR] [--bench DIR] [--micro-batch N] [--warmup N] [--steps N]
#
#   --bundle DIR  built artifacts, made here by scripts/gpu-bundle.sh (default target/gpu-bundle,
#                 or $DS_GPU_BUNDLE), each as is, .xz or .gz: nccl_device, the ds-comm NCCL smoke
#                 test; ds-rs, the cuda build; gpu_buffers, the GPU buffers' kernel test;
#                 gpu_kernels, the fused kernels' test; REVISION, the commit they were built at.
# Run it from the repo's root (its configs are read), the bundle's copy too.
#   --bench DIR   the peer benchmarks (train_torch.py, gpt.py, make_tokens.py; default the
#                 bundle's bench/, else ../shared/bench beside the repo, or $DS_BENCH_DIR).
#                 Copied to a temp dir first.
#   $PYTHON       the Python with PyTorch (default python3); $TORCH_VENV (default
#                 /opt/torch/.venv) supplies the CUDA 13 and NCCL libraries.
#   $DS_PEAK_TFLOPS  dense bf16 peak for MFU when the GPU's name is not in the table below.
#   $DS_ACCEPTANCE_SKIP  parts to leave out, by function name, or name:first-argument (e.g.
#                 "llama_rows kernel_profile ds_speed:small").
#   $DS_ACCEPTANCE_BUDGET_S  seconds the whole run may take (default 540): every wait is cut to
#                 the time left, and a part that starts with under 30 s left says "skip".
# Each row is printed (and appended to $OUT/rows-so-far.txt) as it is made, so a run cut short
# still says what it measured.
#
# With $OUT set, writes three files there (the device tool returns at most 8): the table
# (gpu-acceptance.txt), the rows as made (rows-so-far.txt) and every log, figure file and
# profile in logs.tgz, packed on exit, also when the run is interrupted.
# Exit status: 0 when nothing failed (skips are not failures), 1 otherwise.
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# the bundle's copy (BUNDLE/gpu-acceptance.sh) is run from the repo's root
[ -d "$repo/configs/examples" ] || repo=$PWD
bundle=${DS_GPU_BUNDLE:-$repo/target/gpu-bundle}
bench=${DS_BENCH_DIR:-}
micro_batch=16 warmup=10 steps=40
while [ $# -gt 0 ]; do
    case $1 in
        --bundle) bundle=$2; shift 2 ;;
        --bench) bench=$2; shift 2 ;;
        --micro-batch) micro_batch=$2; shift 2 ;;
        --warmup) warmup=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "gpu-acceptance: unknown argument $1" >&2; exit 2 ;;
    esac
done
python=${PYTHON:-python3}
budget=${DS_ACCEPTANCE_BUDGET_S:-540}
# absolute paths: some runs change directory first
absolute() { if [ -d "$1" ]; then (cd "$1" && pwd); else echo "$1"; fi; }
bundle=$(absolute "$bundle")
if [ -z "$bench" ]; then
    bench=$bundle/bench
    [ -f "$bench/train_torch.py" ] || bench=$repo/../shared/bench
fi
bench=$(absolute "$bench")
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-acceptance.XXXXXX")
logs=$work/logs
report=${OUT:-$work}
mkdir -p "$logs" "$report"
report=$(absolute "$report")
rows=()
failed=0

# On exit (interrupted too): every log packed into $OUT/logs.tgz, the work dir removed.
finish() {
    if [ -n "${OUT:-}" ]; then
        tar czf "$report/logs.tgz" -C "$logs" . 2>/dev/null || echo "gpu-acceptance: packing the logs failed" >&2
    fi
    rm -rf "$work"
}
trap finish EXIT
trap 'exit 130' INT TERM

# Seconds left of the budget, and a wait of at most $1 seconds cut to them (keeping 15 s for
# the table and the logs).
left() { echo $((budget - SECONDS)); }
limit() {
    local l=$(($(left) - 15))
    [ "$l" -lt "$1" ] || l=$1
    [ "$l" -gt 0 ] || l=1
    echo "$l"
}

row() { # check result figure
    rows+=("$1|$2|$3")
    [ "$2" = FAIL ] && failed=1
    printf '== %s: %s %s\n' "$1" "$2" "$3" | tee -a "$report/rows-so-far.txt"
}

# Runs a part of the checks ("$@": a function and its arguments) unless its function is named
# in $DS_ACCEPTANCE_SKIP (space-separated), so a short GPU lease can leave parts out, or the
# budget is nearly spent.
# A name may also carry the part's first argument ("ds_speed:small").
part() {
    local skip=" ${DS_ACCEPTANCE_SKIP:-} " label="$1${2:+ $2}"
    if [[ $skip == *" $1 "* || $skip == *" $1:${2:-} "* ]]; then
        row "$label" skip "in DS_ACCEPTANCE_SKIP"
    elif [ "$(left)" -lt 30 ]; then
        row "$label" skip "out of time ($budget s budget, DS_ACCEPTANCE_BUDGET_S)"
    else
        "$@"
    fi
}

# The CUDA 13 user-space libraries of the PyTorch venv (as shared/gpu/device-env.sh does), and
# libnccl.so: cudarc opens that name (or .so.1, .so.9-.13), pip's nvidia-nccl ships libnccl.so.2.
cuda_libs() {
    local venv=${TORCH_VENV:-/opt/torch/.venv} d nccl
    # libcuda.so.1 comes with the driver (on the loader's path already on the hosts seen so far).
    for d in /usr/local/nvidia/lib64 "$venv"/lib/python3*/site-packages/nvidia/*/lib; do
        [ -d "$d" ] && LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
    nccl=$(find "$venv" -name 'libnccl.so.2' 2>/dev/null | head -n 1)
    if [ -n "$nccl" ]; then
        mkdir -p "$work/lib"
        ln -sf "$nccl" "$work/lib/libnccl.so"
        LD_LIBRARY_PATH="$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
    echo "libnccl.so -> ${nccl:-none found under $venv}"
}

# The bundle's file $1 (xz- or gzip-compressed, or as is) unpacked at $2; fails when absent.
unpack() { # name dest
    if [ -f "$bundle/$1.xz" ]; then
        if command -v xz >/dev/null; then
            xz -dc "$bundle/$1.xz" >"$2"
        else
            "$python" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
                "$bundle/$1.xz" "$2"
        fi
    elif [ -f "$bundle/$1.gz" ]; then
        gunzip -c "$bundle/$1.gz" >"$2"
    elif [ -f "$bundle/$1" ]; then
        cp "$bundle/$1" "$2"
    else
        return 1
    fi
}

# What the bundle was built from (gpu-bundle.sh writes REVISION) against the repo sent here.
bundle_info() {
    local built here
    built=$(head -n 1 "$bundle/REVISION" 2>/dev/null)
    here=$(git -C "$repo" rev-parse HEAD 2>/dev/null)
    if [ -z "$built" ]; then
        row bundle skip "no REVISION in $bundle"
    elif [ -n "$here" ] && [ "${built%% *}" != "$here" ] &&
        ! git -C "$repo" diff --quiet "${built%% *}" "$here" -- . ':(exclude)*.md' ':(exclude)scripts/gpu-acceptance.sh' 2>/dev/null; then
        row bundle FAIL "built at $built, but the repo here is at $here: rebuild it (scripts/gpu-bundle.sh)"
    else
        row bundle ok "built at $built"
    fi
}

# The peer benchmarks, copied once to $work/bench (the runs write beside them).
bench_copy() {
    [ -f "$bench/train_torch.py" ] || return 1
    [ -d "$work/bench" ] || { mkdir -p "$work/bench" && cp "$bench"/*.py "$work/bench/"; }
}

gpu_info() {
    if ! command -v nvidia-smi >/dev/null; then
        row gpu skip "no nvidia-smi"
        return
    fi
    local q
    q=$(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1 | head -n 1)
    if [ -z "$q" ] || [[ $q == *"failed"* || $q == *"No devices"* ]]; then
        row gpu FAIL "nvidia-smi: $q"
        return
    fi
    gpu_name=${q%%,*}
    row gpu ok "$q"
}

# The ds-comm NCCL smoke test (comm/tests/nccl_device.rs); DS_RS_REQUIRE_GPU=1 so it cannot
# pass by skipping.
nccl_smoke() {
    local bin=$work/nccl_device log=$logs/nccl-smoke.log missing t status
    if ! unpack nccl_device "$bin"; then
        row "nccl smoke" skip "no nccl_device[.xz|.gz] in $bundle (scripts/gpu-bundle.sh)"
        return
    fi
    chmod +x "$bin"
    missing=$(ldd "$bin" 2>&1 | grep 'not found')
    [ -n "$missing" ] && { row "nccl smoke" FAIL "ldd: $missing"; return; }
    DS_RS_REQUIRE_GPU=1 RUST_BACKTRACE=1 NCCL_DEBUG=${NCCL_DEBUG:-VERSION} timeout "$(limit 90)" \
        "$bin" --nocapture --test-threads 1 >"$log" 2>&1
    status=$?
    cat "$log"
    for t in f32 bf16 f16; do
        nccl_row "nccl $t" "one_rank_collectives_$t" "nccl-smoke $t: ok" "$log" \
            "all_reduce sum/avg/max, all_gather, reduce_scatter sum/max, broadcast, barrier; 0..1048583 elems"
    done
    nccl_row "nccl errors" one_rank_rejects_bad_arguments "nccl-smoke bad-arguments: ok" "$log" \
        "length/root/peer checks, abort"
    nccl_row "nccl groups" group_collectives_on_gpu_memory "nccl-smoke groups: ok" "$log" \
        "--dist_backend nccl through ds-comm's groups, one rank: GPU memory to NCCL, host to the links"
    [ $status -ne 0 ] && ! grep -q 'test result: FAILED' "$log" &&
        row "nccl smoke" FAIL "exit $status (crash or timeout), see nccl-smoke.log"
    grep -o 'NCCL version [^ ]*' "$log" | head -n 1
}

# engine/tests/gpu_buffers.rs: the kernels of a step on GPU buffers against the host loops, bit
# for bit (the sum of squares to 1e-12), the device-to-device copies, and ZeRO 2-3's buckets
# and gathers in GPU memory against the host's; DS_RS_REQUIRE_GPU=1.
gpu_buffers() {
    local bin=$work/gpu_buffers log=$logs/gpu-buffers.log t d
    if ! unpack gpu_buffers "$bin"; then
        row "gpu buffers" skip "no gpu_buffers[.xz|.gz] in $bundle (scripts/gpu-bundle.sh)"
        return
    fi
    chmod +x "$bin"
    local missing
    missing=$(ldd "$bin" 2>&1 | grep 'not found')
    [ -n "$missing" ] && { row "gpu buffers" FAIL "ldd: $missing"; return; }
    DS_RS_REQUIRE_GPU=1 RUST_BACKTRACE=1 timeout "$(limit 120)" "$bin" --test-threads 1 >"$log" 2>&1
    cat "$log"
    for t in vector_kernels_match_the_host_loops adam_kernel_matches_the_host_adam; do
        for d in f32 bf16 f16; do
            test_row "${t%%_match*} $d" "${t}_$d" "$log" "the host loop's bits"
        done
    done
    test_row "gpu copies" tensors_and_gpu_buffers_copy_on_the_device "$log" \
        "parameters from a GPU buffer, gradients into one, device to device"
    test_row "gpu pieces to/from host" pieces_stream_between_the_host_and_gpu_buffers "$log" \
        "the offloaded step's transfers, page-locked and double-buffered"
    test_row "zero 2-3 gpu buckets" zero_2_and_3_buckets_and_gathers_in_gpu_memory_match_the_host \
        "$log" "2 ranks on one GPU: buckets and gathers in GPU memory, the host's bits"
}

# nn/tests/gpu_kernels.rs: the fused kernels (kernels/fused.cu) on the GPU against the CPU
# kernels at GPT-2's sizes, f32/bf16/f16, and the flash attention kernels (kernels/flash.cu)
# against f64 attention; a row per test, then one per kernel and dtype with the largest
# difference it printed (for flash_*, as a fraction of each element's own bound).
gpu_kernels() {
    local bin=$work/gpu_kernels log=$logs/gpu-kernels.log t line missing
    if ! unpack gpu_kernels "$bin"; then
        row "fused kernels" skip "no gpu_kernels[.xz|.gz] in $bundle (scripts/gpu-bundle.sh)"
        return
    fi
    chmod +x "$bin"
    missing=$(ldd "$bin" 2>&1 | grep 'not found')
    [ -n "$missing" ] && { row "fused kernels" FAIL "ldd: $missing"; return; }
    DS_RS_REQUIRE_GPU=1 RUST_BACKTRACE=1 timeout "$(limit 180)" "$bin" --test-threads 1 --show-output >"$log" 2>&1
    cat "$log"
    for t in layer_norm_forward_and_backward gelu_forward_and_backward bias_gradient_column_sum \
        causal_softmax_forward_and_backward cross_entropy_and_its_gradient \
        cross_entropy_kept_as_logits_and_lse linear_epilogues_bias_gelu_and_its_gradient \
        embedding_gradient_rows_summed_by_index \
        llama_rms_norm_swiglu_and_rotary users_rms_norm_and_rope_train_on_the_gpu \
        flash_attention_forward_and_backward; do
        test_row "fused ${t%%_and_*}" "$t" "$log" "GPU = CPU kernel within the bounds below"
    done
    # "epilogue WHAT: N of M elements differ from candle's kernels": the epilogues ran
    grep '^epilogue ' "$log" | sed 's/^/  /'
    # "kernel NAME DTYPE: ok, largest difference D (bound B)"; NAME may hold spaces
    while IFS='|' read -r what figure; do
        row "  $what" ok "$figure"
    done < <(sed -nE 's/^kernel (.*): ok, (largest difference .*)$/\1|\2/p' "$log")
}

# A libtest line "test NAME ... ok" makes the row ok; else the panic message says why.
test_row() { # check test log figure
    if grep -q "^test $2 \.\.\. ok" "$3"; then
        row "$1" ok "$4"
    else
        local why
        why=$(grep -A1 "'$2'.*panicked at" "$3" | tail -n 1 | cut -c1-200)
        row "$1" FAIL "${why:-did not pass, see $(basename "$3")}"
    fi
}

# With --nocapture a test's own lines sit between "test NAME ..." and the next test's line: it
# passed when it printed its ok line there; else the line after "panicked at" says why.
nccl_row() { # check test ok-line log figure
    local block why
    block=$(awk -v t="test $2 ..." 'index($0, t) == 1 { on = 1; print; next }
        on && /^(test |failures:|test result:)/ { exit } on' "$4")
    if [ -z "$block" ]; then
        row "$1" FAIL "did not run"
    elif grep -qF "$3" <<<"$block"; then
        row "$1" ok "$5"
    else
        why=$(grep -A1 'panicked at' <<<"$block" | tail -n 1 | cut -c1-200)
        row "$1" FAIL "${why:-see nccl-smoke.log}"
    fi
}

torch_info() {
    local v
    if v=$("$python" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, " + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible"))' 2>&1); then
        row pytorch ok "$v"
    else
        row pytorch skip "$python has no PyTorch: $(tail -n 1 <<<"$v")"
    fi
}

# PyTorch eager (bf16 autocast) on the same GPU: the speed baseline ds-rs must reach.
torch_eager() {
    local preset=$1 dir=$work/bench out=$logs/torch-eager.jsonl
    if ! bench_copy; then
        row "torch eager $preset" skip "no train_torch.py in $bench"
        return
    fi
    # the peer's run, through torch_memory.py where there is one: it also records PyTorch's
    # peak device memory (torch-memory.jsonl) for the memory row
    local memory=$repo/scripts/bench/torch_memory.py run=(train_torch.py)
    [ -f "$memory" ] || memory=$bundle/torch_memory.py # the repo's first: the bundle's may be older
    [ -f "$memory" ] && { cp "$memory" "$dir/"; run=(torch_memory.py "$logs/torch-memory.jsonl"); }
    if ! (cd "$dir" && PYTHONUNBUFFERED=1 timeout "$(limit 150)" "$python" "${run[@]}" --preset "$preset" \
        --device cuda --bf16 --micro-batch "$micro_batch" --warmup "$warmup" --steps "$steps" \
        --tag gpu-acceptance --out "$out" 2>&1 | tee "$logs/torch-$preset.log"); then
        row "torch eager $preset" FAIL "see torch-$preset.log"
        return
    fi
    local figure
    figure=$(mfu "$preset" "$out") || { row "torch eager $preset" FAIL "$figure"; return; }
    row "torch eager $preset" ok "$figure"
}

# MFU = 6 * N * tokens/s / peak, N = every parameter (embeddings and the untied lm_head
# included), attention's score and value products not counted: the formula issue 22 uses.
# Also given: the PaLM / nanoGPT count, (6 * N' + 12 * L * T * d) per token, with N' leaving
# out the two embedding tables (lookups, not matmuls) and 12*L*T*d counting attention's two
# T x T products in forward and backward (not halved for the causal mask).
# The presets' sizes are read from gpt.py's source (importing it would import torch); the
# Python's error, when it fails, is the figure's last line.
mfu() { # preset jsonl
    local figure
    figure=$("$python" - "$1" "$2" "$bench/gpt.py" "${gpu_name:-}" "${DS_PEAK_TFLOPS:-}" 2>&1 <<'EOF'
import ast, json, sys
preset, path, gpt_py, name, peak_env = sys.argv[1:]
def presets(source):
    # PRESETS = {"tiny": dict(V=4096, ...), ...}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "PRESETS" for t in node.targets):
            return {ast.literal_eval(k): {kw.arg: ast.literal_eval(kw.value) for kw in v.keywords}
                    for k, v in zip(node.value.keys, node.value.values)}
    raise SystemExit(f"no PRESETS in {gpt_py}")
try:
    cfg = presets(open(gpt_py).read())[preset]
except OSError:
    cfg = None  # no peer benchmark here: MFU by 6N alone
res = [r for r in map(json.loads, open(path)) if r["preset"] == preset][-1]
tok_s, n = res["tokens_per_s"], res["params"]
# Dense bf16 peak in TFLOP/s by name (vendor datasheets); H100 SXM = "H100 80GB HBM3".
table = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.4), ("H200", 989.4),
         ("H100", 989.4), ("A100", 312.0)]
peak = float(peak_env) if peak_env else next((p for k, p in table if k in name), None)
fig = (f"{tok_s:,.0f} tok/s, step {res['step_ms_median']:.1f} ms (median), "
       f"B={res['micro_batch']}" + (f" T={cfg['T']}" if cfg else "") + f", {n/1e6:.1f}M params")
if peak:
    fig += f", MFU(6N) {100 * 6 * n * tok_s / (peak * 1e12):.1f}%"
    if cfg:
        V, T, d, L = cfg["V"], cfg["T"], cfg["d"], cfg["L"]
        palm = (6 * (n - V * d - T * d) + 12 * L * T * d) * tok_s / (peak * 1e12)
        fig += f", MFU(PaLM) {100 * palm:.1f}%"
    fig += f" of {peak:g} TFLOP/s"
else:
    fig += f", MFU n/a (no peak for {name!r}; set DS_PEAK_TFLOPS)"
print(fig)
EOF
) || { tail -n 1 <<<"$figure"; return 1; }
    echo "$figure"
}

# ds-rs's own runs on the device, from the cuda build (scripts/check-cuda.sh, then
# scripts/gpu-bundle.sh): the same binary trains on the CPU there too, so the equality runs need
# nothing else.
ds_rs_runs() {
    bin=$work/ds-rs
    if ! unpack ds-rs "$bin"; then
        local c why="no ds-rs cuda binary in $bundle (scripts/check-cuda.sh, scripts/gpu-bundle.sh)"
        for c in "ds-rs tiny fp32 gpu=cpu" "ds-rs tiny bf16 gpu~cpu" "ds-rs small bf16" "ds-rs gpt2 bf16" \
            "profile gpt2" "attention" "ds-rs llama3-1b"; do
            row "$c" skip "$why"
        done
        return
    fi
    chmod +x "$bin"
    local missing
    missing=$(ldd "$bin" 2>&1 | grep 'not found')
    [ -n "$missing" ] && { row "ds-rs" FAIL "ldd: $missing"; return; }
    choose_paths
    # fp32 on both: the same arithmetic but cuBLAS's summation order, so the losses of 10 steps
    # agree to about 1e-5 relative; bf16 on the GPU rounds every product's inputs to 8 bits.
    local ex=$repo/configs/examples z3=$work/zero3-2ranks.json
    part ds_equality "ds-rs tiny fp32 gpu=cpu" "$ex/zero2.json" 1e-4
    part ds_equality "ds-rs tiny bf16 gpu~cpu" "$ex/bf16.json" 3e-2
    # fp16 against fp16 on the CPU: the loss scaler skips the same overflowing steps on both.
    part ds_equality "ds-rs tiny fp16 gpu~cpu" "$ex/fp16.json" 3e-2 1 "$ex/fp16.json"
    # Two ranks sharing GPU 0 at ZeRO-3 (the built-in transport between their host buffers),
    # the same global batch of 8, against one CPU rank.
    derive "$ex/zero2.json" "$z3" '{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}'
    part ds_equality "ds-rs tiny zero3 x2 gpu=cpu" "$z3" 1e-4 2
    # NCCL between two GPUs at ZeRO-1 (device-resident buffers, NCCL all-reduce and
    # all-gather), the global batch of 8: NCCL refuses two ranks on one GPU, so it needs two.
    local z1=$work/zero1-2ranks.json gpus
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    derive "$ex/zero2.json" "$z1" '{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}'
    if [ "${gpus:-0}" -ge 2 ]; then
        part ds_equality "ds-rs tiny nccl x2 gpu=cpu" "$z1" 1e-4 2 "" nccl
    else
        row "ds-rs tiny nccl x2 gpu=cpu" skip "needs two GPUs ($gpus here): NCCL refuses two ranks on one"
    fi
    # ZeRO-Offload: the master copy and Adam's moments in host memory (the CPU Adam), the
    # parameters and gradients on the GPU; against one CPU rank.
    local off=$work/offload.json
    derive "$ex/zero2.json" "$off" '{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}'
    part ds_equality "ds-rs tiny offload gpu=cpu" "$off" 1e-4
    # train's last line on a GPU: the device, its MFU and its memory in use (summary.json "gpu").
    local g
    if [ -f "$logs/ds-rs-equality.log" ]; then
        g=$(grep -h 'gpu (rank 0): ' "$logs/ds-rs-equality.log" | tail -n 1)
        case $g in
            *"gpu (rank 0): "*) row "ds-rs train gpu line" ok "${g#*gpu (rank 0): }" ;;
            *) row "ds-rs train gpu line" FAIL "train printed no gpu line" ;;
        esac
    else
        row "ds-rs train gpu line" skip "no equality run (ds_equality skipped)"
    fi
    part ds_speed small
    part ds_speed gpt2
    part device_memory gpt2
    part ds_speed gpt2 matmul
    part ds_speed gpt2 flash candle
    part attention_rows
    part kernel_profile gpt2
    part ds_offload_memory gpt2
    part llama_rows
}

# Causal attention alone, forward and backward, in bf16 at GPT-2's shape (B 16, H 12, T 1024,
# hd 64) and Llama 3.2 1B's (B 4, H 32 over 8 key/value heads): ds-rs's flash kernels and its
# T x T path (`ds-rs bench attention`) against PyTorch's SDPA in the same call
# (scripts/bench/attention_torch.py); TFLOP/s by FlashAttention's count.
attention_rows() {
    local shape name args figure out=$logs/attention.jsonl script=$repo/scripts/bench/attention_torch.py
    [ -f "$script" ] || script=$bundle/attention_torch.py # the repo's first: the bundle's may be older
    for shape in "gpt2|--batch 16 --heads 12 --seq-len 1024 --head-dim 64" \
        "llama3-1b|--batch 4 --heads 32 --kv-heads 8 --seq-len 1024 --head-dim 64"; do
        name=${shape%%|*}
        args=${shape#*|}
        # shellcheck disable=SC2086 # the shape's flags, split on purpose
        if ! timeout "$(limit 120)" "$bin" bench attention --device cuda --dtype bf16 $args --json \
            >"$work/attention-ds.jsonl" 2>"$logs/attention-$name.log"; then
            row "attention $name" FAIL "$(tail -n 1 "$logs/attention-$name.log")"
            continue
        fi
        # shellcheck disable=SC2086
        timeout "$(limit 120)" "$python" "$script" --device cuda --dtype bf16 $args \
            >"$work/attention-torch.jsonl" 2>>"$logs/attention-$name.log" || : >"$work/attention-torch.jsonl"
        cat "$work/attention-ds.jsonl" "$work/attention-torch.jsonl" >>"$out"
        figure=$("$python" - "$work/attention-ds.jsonl" "$work/attention-torch.jsonl" 2>&1 <<'PY'
import json, sys
rows = [json.loads(l) for p in sys.argv[1:] for l in open(p) if l.strip()]
by = {r["path"]: r for r in rows}
parts = [f"{p} {r['median_ms']:.2f} ms ({r['tflops']:.0f} TFLOP/s)" if "median_ms" in r
         else f"{p} skipped" for p, r in by.items()]
torch = by.get("torch-sdpa", {}).get("median_ms")
for p in ("flash", "matmul"):
    if torch and "median_ms" in by.get(p, {}):
        parts.append(f"{p}/torch time {by[p]['median_ms'] / torch:.2f}x")
print(", ".join(parts) if torch else ", ".join(parts) + ", torch sdpa did not run")
PY
) || { row "attention $name" FAIL "$(tail -n 1 <<<"$figure")"; continue; }
        row "attention $name" ok "$figure"
    done
}

# Device memory of preset $1 in bf16 at ZeRO-1 on one GPU, without and with offload_optimizer
# (expected: about 12 bytes per parameter less, the fp32 master copy and Adam's two moments),
# from train's summary.json: the driver's peak, ds-rs's own GPU bytes, and tokens/s.
ds_offload_memory() { # preset
    local d=$work/offload-$1 side cfg figure
    for side in none cpu; do
        cfg=$work/offload-$side.json
        derive "$repo/configs/examples/bf16.json" "$cfg" "{\"train_micro_batch_size_per_gpu\": 8,
            \"gradient_accumulation_steps\": 1,
            \"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": {\"device\": \"$side\"}}}"
        if ! timeout "$(limit 300)" "$bin" train --model "$1" --steps 6 --eval-batches 1 --device cuda \
            --config "$cfg" --metrics-dir "$d/$side" >"$logs/ds-rs-offload-$side.log" 2>&1; then
            row "ds-rs $1 offload" FAIL "offload $side: $(tail -n 1 "$logs/ds-rs-offload-$side.log")"
            return
        fi
    done
    figure=$("$python" - "$d/none/summary.json" "$d/cpu/summary.json" 2>&1 <<'PY'
import json, sys
none, cpu = (json.load(open(p)) for p in sys.argv[1:])
def side(s):
    g = s["gpu"]
    return g["memory_used_peak_mib"], g["accounted_mib"], s["median_tokens_per_s"]
(u0, a0, t0), (u1, a1, t1) = side(none), side(cpu)
print(f"driver peak {u0:.0f} -> {u1:.0f} MiB ({u0 - u1:.0f} less); ds-rs's GPU bytes "
      f"{a0:.0f} -> {a1:.0f} MiB; tokens/s {t0:,.0f} -> {t1:,.0f}")
PY
) || { row "ds-rs $1 offload" FAIL "$(tail -n 1 <<<"$figure")"; return; }
    row "ds-rs $1 offload" ok "$figure"
}

# Where the step's time goes: preset $1's bf16 bench (the ds_speed config) and PyTorch eager's
# train_torch.py, each under the CUPTI kernel profiler of the bundle (scripts/gpu-kernel-profile.c:
# GPU time per kernel name); a row each with the GPU time by kernel family, the full tables in
# kernel-profile-*.tsv.
kernel_profile() { # preset
    local lib=$bundle/libds_kernel_profile.so out rc
    mkdir -p "$work/cupti"
    if [ ! -f "$lib" ] || ! unpack libcupti.so.13 "$work/cupti/libcupti.so.13"; then
        row "profile $1" skip "no libds_kernel_profile.so / libcupti.so.13[.xz|.gz] in $bundle (scripts/gpu-bundle.sh)"
        return
    fi
    speed_config
    out=$logs/kernel-profile-ds-rs-$1.tsv
    LD_LIBRARY_PATH="$work/cupti${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_INJECTION64_PATH=$lib \
        DS_KERNEL_PROFILE=$out timeout "$(limit 200)" "$bin" bench train --preset "$1" \
        --config "$work/bf16-speed.json" --nproc 1 --device cuda --warmup 2 --steps 5 \
        >"$logs/profile-ds-rs-$1.log" 2>&1
    rc=$?
    families "profile ds-rs $1" "$out" 7 "profile-ds-rs-$1.log" $rc
    if ! bench_copy; then
        row "profile torch $1" skip "no train_torch.py in $bench"
        return
    fi
    out=$logs/kernel-profile-torch-$1.tsv
    (cd "$work/bench" && LD_LIBRARY_PATH="$work/cupti${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        CUDA_INJECTION64_PATH=$lib DS_KERNEL_PROFILE=$out timeout "$(limit 150)" "$python" \
        train_torch.py --preset "$1" --device cuda --bf16 --micro-batch "$micro_batch" --warmup 2 \
        --steps 5 --tag profile --out "$work/profile-torch.jsonl") >"$logs/profile-torch-$1.log" 2>&1
    rc=$?
    families "profile torch $1" "$out" 7 "profile-torch-$1.log" $rc
}

# A row from a kernel profile: GPU time by family (first pattern that matches a kernel's name),
# and the GPU's busy time per step (the profile's total over the run's $3 steps, warmup
# included) beside the span from its first kernel to its last: a busy time well under the
# speed row's median step means the host, not the GPU, sets the pace.
families() { # check tsv steps log exit-status
    local figure
    if [ ! -s "$2" ]; then
        row "$1" FAIL "no profile written (exit $5; see $4)"
        return
    fi
    figure=$("$python" - "$2" "$3" 2>&1 <<'PY'
import re, sys
lines = open(sys.argv[1]).read().splitlines()
head = re.search(r"([\d.]+) ms on the GPU, first to last ([\d.]+) ms", lines[0] if lines else "")
steps = int(sys.argv[2])
rows = [l.split("\t") for l in lines if l[:1].isdigit()]
families = [
    ("matmul", r"gemm|xmma|cutlass|nvjet|^sm\d+_|ampere|hopper|cublas|splitK|Kernel2"),
    ("attention", r"flash|fmha|attention|sdpa|mha"),
    ("ds-rs fused", r"^(layer_norm|rms_norm|gelu_|swiglu|rotary|causal_softmax|softmax_bwd|cross_entropy|column_sum|sum_partials|mean_of_rows)"),
    ("optimizer", r"^(adam_|accumulate_|scale_|sum_squares_|convert_)|adam|foreach|multi_tensor"),
    ("copies", r"^\[memcpy|copy"),
    ("memset/fill", r"^\[memset\]|fill"),
    ("elementwise", r"affine|^b(add|sub|mul|div|maximum|minimum)|^u[a-z]|cast|where|elementwise|vectorized|unrolled"),
    ("reductions", r"reduce|sum|max|min|softmax|norm"),
]
total = sum(float(r[0]) for r in rows) or 1.0
by = {}
for ms, calls, mean, name in rows:
    fam = next((f for f, p in families if re.search(p, name, re.I)), "other")
    by[fam] = by.get(fam, 0.0) + float(ms)
busy = (f", busy {total / steps:.1f} ms a step of {steps}, span {float(head.group(2)):.0f} ms"
        if head else "")
print(f"{total:.0f} ms GPU{busy}: " + ", ".join(f"{f} {100 * t / total:.0f}%" for f, t in sorted(by.items(), key=lambda x: -x[1])))
PY
) || { row "$1" FAIL "$(tail -n 1 <<<"$figure")"; return; }
    # a run that failed after some kernels still wrote a profile: say so beside it
    [ "$5" -eq 0 ] || { row "$1" FAIL "exit $5 (see $4); partial profile: $figure"; return; }
    row "$1" ok "$figure"
}

# Llama 3.2 1B (the llama3-1b preset, 1.24B parameters) on one GPU, bf16, micro-batch 4 of 1024
# positions: ds-rs at ZeRO-1, and at ZeRO-3 with the optimizer offloaded to the CPU (train's
# summary.json: median tokens/s, the driver's peak device memory), then PyTorch eager training
# transformers' LlamaForCausalLM of the same config (scripts/bench/llama_torch.py in the bundle:
# tokens/s, max_memory_allocated; the plain-PyTorch Llama where the host has no transformers).
llama_rows() {
    local d=$work/llama side zero cfg figure
    for side in zero1 zero3-offload; do
        case $side in
            zero1) zero='{"stage": 1}' ;;
            *) zero='{"stage": 3, "offload_optimizer": {"device": "cpu"}}' ;;
        esac
        cfg=$work/llama-$side.json
        derive "$repo/configs/examples/bf16.json" "$cfg" "{\"train_micro_batch_size_per_gpu\": 4,
            \"gradient_accumulation_steps\": 1, \"zero_optimization\": $zero}"
        if ! timeout "$(limit 300)" "$bin" train --model llama3-1b --seq-len 1024 --steps 6 --eval-batches 1 \
            --device cuda --config "$cfg" --metrics-dir "$d/$side" >"$logs/ds-rs-llama-$side.log" 2>&1; then
            row "ds-rs llama3-1b $side" FAIL "$(tail -n 1 "$logs/ds-rs-llama-$side.log")"
            continue
        fi
        figure=$("$python" - "$d/$side/summary.json" 2>&1 <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
g = s.get("gpu")
if not g:
    sys.exit("train's summary.json has no gpu section")
num = lambda k, f: "n/a" if g.get(k) is None else format(g[k], f)
mfu = "n/a" if g.get("mfu") is None else f"{100 * g['mfu']:.1f}%"
print(f"{s['median_tokens_per_s']:,.0f} tok/s, driver peak {num('memory_used_peak_mib', '.0f')} MiB "
      f"(ds-rs's GPU bytes {num('accounted_mib', '.0f')} MiB), MFU {mfu}")
PY
) || { row "ds-rs llama3-1b $side" FAIL "$(tail -n 1 <<<"$figure")"; continue; }
        row "ds-rs llama3-1b $side" ok "$figure"
    done
    local script=$repo/scripts/bench/llama_torch.py out=$logs/torch-llama.json
    [ -f "$script" ] || script=$bundle/llama_torch.py # the repo's first: the bundle's may be older
    if ! timeout "$(limit 200)" "$python" "$script" --preset llama3-1b --device cuda --micro-batch 4 \
        --seq-len 1024 --warmup 2 --steps 5 >"$out" 2>"$logs/torch-llama.log"; then
        row "torch eager llama3-1b" FAIL "$(tail -n 1 "$logs/torch-llama.log")"
        return
    fi
    figure=$("$python" - "$out" 2>&1 <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['tokens_per_s']:,.0f} tok/s ({r['impl']}), max_memory_allocated "
      f"{r['max_memory_allocated_mib']:.0f} MiB, reserved {r['max_memory_reserved_mib']:.0f} MiB")
PY
) || { row "torch eager llama3-1b" FAIL "$(tail -n 1 <<<"$figure")"; return; }
    row "torch eager llama3-1b" ok "$figure"
}

# A copy of config $1 at $2 with the top-level keys of the JSON object $3 replaced.
derive() {
    "$python" -c 'import json, sys; c = json.load(open(sys.argv[1])); c.update(json.loads(sys.argv[3])); json.dump(c, open(sys.argv[2], "w"))' "$@"
}

# 10 steps of preset tiny on the GPU (config $2, $4 ranks sharing GPU 0) against one CPU rank
# (config $5, default fp32 ZeRO-2): the largest relative loss difference within $3.
# With [backend] nccl each rank takes its own GPU (LOCAL_RANK's) and reduces over NCCL.
ds_equality() { # check config tolerance [nproc] [cpu-config] [backend]
    local d=$work/eq-$RANDOM log=$logs/ds-rs-equality.log verdict n=${4:-1}
    local cpu_cfg=${5:-$repo/configs/examples/zero2.json} gpu=("$bin" train) dev=cuda
    [ "$n" -gt 1 ] && { gpu=("$bin" launch --nproc_per_node "$n" train); dev=cuda:0; }
    [ "${6:-}" = nccl ] && { gpu+=(--dist_backend nccl); dev=cuda; }
    mkdir -p "$d"
    {
        echo "== $1"
        timeout "$(limit 200)" "$bin" train --model tiny --steps 10 --eval-batches 1 --device cpu \
            --config "$cpu_cfg" --metrics-dir "$d/cpu" &&
            timeout "$(limit 200)" "${gpu[@]}" --model tiny --steps 10 --eval-batches 1 --device "$dev" \
                --config "$2" --metrics-dir "$d/gpu"
    } >>"$log" 2>&1 || { row "$1" FAIL "see ds-rs-equality.log"; tail -n 5 "$log"; return; }
    verdict=$("$python" - "$d/cpu/metrics.jsonl" "$d/gpu/metrics.jsonl" "$3" 2>&1 <<'EOF'
import json, sys
def losses(p):
    return [r["loss"] for r in map(json.loads, open(p)) if "loss" in r and "step" in r]
cpu, gpu, tol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
if not cpu or not gpu:
    sys.exit(f"FAIL|no losses: {len(cpu)} on the cpu, {len(gpu)} on the gpu")
rel = max(abs(g - c) / abs(c) for c, g in zip(cpu, gpu))
ok = len(cpu) == len(gpu) == 10 and rel < tol
print(("ok" if ok else "FAIL") + f"|{len(gpu)} steps, largest relative loss difference {rel:.2e} "
      f"(tolerance {tol:g}); step 10: cpu {cpu[-1]:.6f}, gpu {gpu[-1]:.6f}")
EOF
)
    verdict=$(tail -n 1 <<<"$verdict")
    case $verdict in
        ok\|* | FAIL\|*) row "$1" "${verdict%%|*}" "${verdict#*|}" ;;
        *) row "$1" FAIL "the comparison failed: $verdict" ;;
    esac
}

# Tokens/s and MFU, bf16, the micro-batch of the PyTorch rows, one rank on GPU 0.
# The speed runs' ds_config (bf16, ZeRO-0, PyTorch eager's optimizer), at $work/bf16-speed.json.
speed_config() {
    cat >"$work/bf16-speed.json" <<EOF
{"train_micro_batch_size_per_gpu": $micro_batch, "gradient_accumulation_steps": 1,
 "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
 "bf16": {"enabled": true}, "zero_optimization": {"stage": 0}}
EOF
}

# Peak device memory of preset $1 at the speed rows' micro-batch: ds-rs's allocation peak
# (candle's memory pool at its fullest and the ZeRO buffers, from the default speed row)
# against PyTorch eager's max_memory_allocated (torch-memory.jsonl, from its speed row), with
# the reserved figures beside them (the driver's count after each step for ds-rs, whose pool
# keeps its freed memory; PyTorch's caching allocator's reserve).
device_memory() { # preset
    local ours=$logs/ds-rs-speed-$1-${DS_RS_ATTENTION:-flash}-${DS_RS_MATMUL:-lt}.jsonl
    local theirs=$logs/torch-memory.jsonl verdict
    [ -s "$theirs" ] || { row "$1 device memory" skip "no PyTorch memory figure (torch-memory.jsonl)"; return; }
    [ -s "$ours" ] || { row "$1 device memory" skip "no ds-rs speed figure ($(basename "$ours"))"; return; }
    verdict=$("$python" - "$1" "$ours" "$theirs" 2>&1 <<'PY'
import json, sys
preset, ours, theirs = sys.argv[1:]
last = lambda p: [r for r in map(json.loads, open(p)) if r.get("preset") == preset][-1]
o, t = last(ours), last(theirs)
a, u = o.get("gpu_memory_allocated_peak_mib"), o.get("gpu_memory_used_peak_mib")
if a is None:
    print(f"FAIL|ds-rs reported no allocation peak (driver's count {u} MiB)")
    sys.exit()
ta, tr = t["max_memory_allocated_mib"], t["max_memory_reserved_mib"]
verdict = "ok" if a <= ta else "FAIL"
print(f"{verdict}|allocated at most: ds-rs {a:.0f} MiB, PyTorch {ta:.0f} MiB ({a / ta:.2f}x); "
      f"reserved: ds-rs {u:.0f} MiB (driver, context included), PyTorch {tr:.0f} MiB; "
      f"B={o['micro_batch']} (PyTorch B={t['micro_batch']})")
PY
) || { row "$1 device memory" FAIL "$(tail -n 1 <<<"$verdict")"; return; }
    row "$1 device memory" "${verdict%%|*}" "${verdict#*|}"
}

# Which bf16 paths train on this GPU, from 2 steps of preset tiny each way, the defaults first:
# the first that works is exported (DS_RS_ATTENTION, DS_RS_MATMUL) for every later run that
# does not compare the paths itself, so one broken kernel does not cost the lease's other
# figures (its own rows still fail and say why).
choose_paths() {
    local pair attention linears why=""
    speed_config
    for pair in "flash lt" "matmul lt" "flash candle" "matmul candle"; do
        read -r attention linears <<<"$pair"
        if DS_RS_ATTENTION=$attention DS_RS_MATMUL=$linears timeout "$(limit 90)" "$bin" bench train \
            --preset tiny --config "$work/bf16-speed.json" --nproc 1 --device cuda --warmup 1 \
            --steps 2 --json >"$logs/paths-$attention-$linears.jsonl" 2>"$logs/paths-$attention-$linears.log"; then
            export DS_RS_ATTENTION=$attention DS_RS_MATMUL=$linears
            if [ -z "$why" ]; then
                row "gpu paths" ok "bf16 trains with the flash kernels and cuBLASLt's epilogues (the defaults)"
            else
                row "gpu paths" FAIL "the rest runs with attention $attention, linears $linears:$why"
            fi
            return
        fi
        why="$why $attention+$linears failed ($(tail -n 1 "$logs/paths-$attention-$linears.log" | cut -c1-160));"
    done
    row "gpu paths" FAIL "no bf16 path trains:$why"
}

# Attention $2: flash (the default, kernels/flash.cu) or matmul (DS_RS_ATTENTION=matmul: the
# T x T probabilities through cuBLAS and the fused softmax), the comparison that decides it.
# Linears $3: lt (the default: cuBLASLt's bias and GELU epilogues, kernels/gpu/lt.rs) or
# candle (DS_RS_MATMUL=candle: candle's matmul, then the bias and GELU kernels).
# Without them, the paths choose_paths found working (the defaults where they train).
ds_speed() { # preset [attention] [linears]
    local attention=${2:-${DS_RS_ATTENTION:-flash}} linears=${3:-${DS_RS_MATMUL:-lt}} figure
    local variant=$attention-$linears cfg=$work/bf16-speed.json
    local out=$logs/ds-rs-speed-$1-$variant.jsonl label="ds-rs $1 bf16" log=ds-rs-$1-$variant.log
    [ "$attention" = flash ] || label="$label $attention-attn"
    [ "$linears" = lt ] || label="$label $linears-matmul"
    # the paths choose_paths fell back to, asked for again by name
    [ -s "$out" ] && { row "$label" skip "measured above (the paths the runs fell back to)"; return; }
    speed_config
    if ! DS_RS_ATTENTION=$attention DS_RS_MATMUL=$linears timeout "$(limit 300)" "$bin" bench train --preset "$1" --config "$cfg" \
        --nproc 1 --device cuda --warmup "$warmup" --steps "$steps" --json >>"$out" 2>"$logs/$log"; then
        row "$label" FAIL "see $log: $(tail -n 1 "$logs/$log")"
        return
    fi
    figure=$(mfu "$1" "$out") || { row "$label" FAIL "$figure"; return; }
    row "$label" ok "$figure"
}

cuda_libs
bundle_info
gpu_info
part nccl_smoke
part gpu_buffers
part gpu_kernels
torch_info
part torch_eager small
part torch_eager gpt2
ds_rs_runs

{
    echo
    printf '%-24s | %-6s | %s\n' check result figure
    printf '%-24s-+-%-6s-+-%s\n' "------------------------" "------" "------"
    for r in "${rows[@]}"; do
        IFS='|' read -r c s f <<<"$r"
        printf '%-24s | %-6s | %s\n' "$c" "$s" "$f"
    done
} | tee "$report/gpu-acceptance.txt"
exit $failed
