#!/usr/bin/env bash
# Builds ds-rs with the `cuda` feature here, where there is no GPU (issue 22: run it before every
# stop that touches device code; not in CI, the first build takes 20-40 minutes on 2 cores):
# the CUDA 13.0 toolchain from PyPI (scripts/install-cuda-toolchain.sh), then
# target/cuda/release/ds-rs, then a check that the binary starts and refuses `--device cuda`
# cleanly on this GPU-less machine (the link stub answers CUDA_ERROR_STUB_LIBRARY).
#
#   scripts/check-cuda.sh            # JOBS=N for more parallel compile jobs (default 1)
set -euo pipefail
cd "$(dirname "$0")/.."
nice -n 19 bash scripts/install-cuda-toolchain.sh >/dev/null
eval "$(bash scripts/install-cuda-toolchain.sh --print-env)"
CARGO_TARGET_DIR=target/cuda nice -n 19 cargo build --release -j "${JOBS:-1}" --features cuda --bin ds-rs
# The fused kernels launch up to 1024 threads a block (nn/src/kernels/gpu/launch.rs): each may
# use at most 64 registers (65,536 per SM on every GPU since sm_50) and must not spill.
regs=$(nvcc -cubin -arch=sm_90 -fmad=false -O3 -Xptxas -v -o /dev/null nn/kernels/fused.cu 2>&1)
most=$(grep -oE 'Used [0-9]+ registers' <<<"$regs" | awk '{ if ($2 > m) m = $2 } END { print m + 0 }')
if [ "$most" -gt 64 ] || grep -qE '[1-9][0-9]* bytes spill' <<<"$regs"; then
    echo "check-cuda: fused.cu needs $most registers a thread or spills; 1024-thread blocks would not launch" >&2
    exit 1
fi
echo "check-cuda: fused.cu's kernels use at most $most registers a thread, no spills"
# The flash kernels run blocks of 64 or 128 threads, so up to 255 registers a thread launch;
# their tiles are dynamic shared memory (launch.rs's flash_shared_bytes, up to 56 KiB), so
# ptxas reports no static shared memory for them. Spills are reported (none so far).
regs=$(nvcc -cubin -arch=sm_90 -fmad=false -O3 -Xptxas -v -o /dev/null nn/kernels/flash.cu 2>&1)
most=$(grep -oE 'Used [0-9]+ registers' <<<"$regs" | awk '{ if ($2 > m) m = $2 } END { print m + 0 }')
spill=$(grep -oE '[0-9]+ bytes spill stores' <<<"$regs" | awk '{ if ($1 > m) m = $1 } END { print m + 0 }')
smem=$({ grep -oE '[0-9]+ bytes smem' <<<"$regs" || true; } | awk '{ if ($1 > m) m = $1 } END { print m + 0 }')
echo "check-cuda: flash.cu's kernels use at most $most registers a thread, $smem bytes of static shared memory a block, spill at most $spill bytes"
bin=target/cuda/release/ds-rs
out=$(LD_LIBRARY_PATH="$CUDA_HOME/stub-runtime:$CUDA_HOME/lib64" "$bin" train --device cuda --steps 1 2>&1) && {
    echo "check-cuda: --device cuda trained on a machine with no GPU?" >&2
    exit 1
}
grep -q "device cuda:0" <<<"$out" || { echo "check-cuda: unexpected failure: $out" >&2; exit 1; }
echo "check-cuda: $bin built; without a GPU it says: $(grep error <<<"$out" | head -n 1)"
