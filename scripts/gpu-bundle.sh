#!/usr/bin/env bash
# Builds here (no GPU needed) what scripts/gpu-acceptance.sh runs on a GPU host, and packs it,
# with that script and the peer benchmarks, into one folder to copy there: the NCCL smoke test
# and, when scripts/check-cuda.sh has built it, the cuda ds-rs binary.
#
#   scripts/gpu-bundle.sh [--bench DIR] [--out DIR]
#
#   --bench DIR  the peer benchmarks (default ../shared/bench beside the repo, or $DS_BENCH_DIR)
#   --out DIR    the bundle (default target/gpu-bundle, or $DS_GPU_BUNDLE); emptied first
#
# On the GPU host: bash BUNDLE/gpu-acceptance.sh --bundle BUNDLE
# The binaries are packed with xz (half gzip's size: the device tool carries at most 64 MiB
# with the working tree); REVISION names the commit they were built from.
# The NCCL smoke test needs no CUDA toolkit to build: cudarc opens libcuda and libnccl at run
# time. Honours CARGO_TARGET_DIR; build with nice and CARGO_BUILD_JOBS=1 on a shared machine.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bench=${DS_BENCH_DIR:-$repo/../shared/bench}
out=${DS_GPU_BUNDLE:-$repo/target/gpu-bundle}
while [ $# -gt 0 ]; do
    case $1 in
        --bench) bench=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "gpu-bundle: unknown argument $1" >&2; exit 2 ;;
    esac
done

cd "$repo"
# A test binary's path (`test_binary CRATE FEATURES TEST`, built if need be), from cargo's JSON
# messages: its name carries a hash.
test_binary() {
    cargo test -p "$1" --features "$2" --release --test "$3" --no-run \
        --message-format=json-render-diagnostics |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$3"
}
bin=$(test_binary ds-comm nccl nccl_device)
[ -n "$bin" ] || { echo "gpu-bundle: no nccl_device test binary was built" >&2; exit 1; }

# xz at one thread: the machine's other core is usually busy with a build or CI
pack() { xz -9 -T1 -c "$1" >"$2.xz"; }
rm -rf "$out"
mkdir -p "$out/bench"
pack "$bin" "$out/nccl_device"
# ds-rs with the cuda feature (scripts/check-cuda.sh builds it: 20-40 minutes the first time),
# and the GPU buffers' and fused kernels' tests against their host side (engine/tests/gpu_buffers.rs,
# nn/tests/gpu_kernels.rs) built beside it.
cuda_bin=${DS_RS_CUDA_BIN:-$repo/target/cuda/release/ds-rs}
if [ -x "$cuda_bin" ]; then
    pack "$cuda_bin" "$out/ds-rs"
    eval "$(bash scripts/install-cuda-toolchain.sh --print-env)"
    for crate_test in ds-engine:gpu_buffers ds-nn:gpu_kernels; do
        t=${crate_test#*:}
        b=$(CARGO_TARGET_DIR=$(dirname "$(dirname "$cuda_bin")") test_binary "${crate_test%%:*}" cuda "$t")
        [ -n "$b" ] && pack "$b" "$out/$t"
    done
else
    echo "gpu-bundle: no $cuda_bin (scripts/check-cuda.sh); the ds-rs rows will be skipped" >&2
fi
# The kernel profiler (a CUPTI injection library, scripts/gpu-kernel-profile.c) and the CUPTI
# library it needs, so the breakdown does not depend on what the GPU host has installed.
eval "$(bash scripts/install-cuda-toolchain.sh --print-env)"
gcc -shared -fPIC -O2 -Wall -I"$CUDA_HOME/include" -o "$out/libds_kernel_profile.so" \
    scripts/gpu-kernel-profile.c -L"$CUDA_HOME/lib64" -lcupti
pack "$CUDA_HOME/lib64/libcupti.so.13" "$out/libcupti.so.13"
cp scripts/gpu-acceptance.sh scripts/bench/llama_torch.py scripts/bench/attention_torch.py \
    scripts/bench/torch_memory.py "$out/"
if [ -f "$bench/train_torch.py" ]; then
    cp "$bench"/train_torch.py "$bench"/gpt.py "$bench"/make_tokens.py "$out/bench/"
    chmod u+w "$out"/bench/*.py
else
    echo "gpu-bundle: no train_torch.py in $bench; the PyTorch baseline will be skipped" >&2
fi
dirty=$(git status --porcelain --untracked-files=no | wc -l)
echo "$(git rev-parse HEAD)$([ "$dirty" -eq 0 ] || echo " with $dirty files changed")" >"$out/REVISION"
du -sh "$out"
ls -l "$out" "$out/bench"
