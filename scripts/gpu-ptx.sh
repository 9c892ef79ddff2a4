#!/usr/bin/env bash
# On a GPU host: the model layer's kernels (nn/kernels/fused.cu, flash.cu) of the working tree
# compiled to PTX in DIR, with the flags the build uses (read from build-support/ptx.rs), for
# DS_RS_PTX_DIR=DIR: a kernel's body changed there is measured by the bundle's ds-rs without
# rebuilding it (nn/src/kernels/gpu/ptx.rs). The launches stay the build's, so a change
# must keep the kernel's arguments, grid and shared memory as they are.
#
#   scripts/gpu-ptx.sh DIR [fused] [flash]    # both when none is named
#   DS_RS_PTX_DIR=DIR ds-rs bench attention --device cuda ...
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ $# -ge 1 ] || { sed -n '2,9p' "$0"; exit 2; }
dir=$1
shift
kernels=("$@")
[ ${#kernels[@]} -gt 0 ] || kernels=(fused flash)
# the nvcc arguments of compile_ptx, e.g. .args(["--ptx", "-arch=compute_80", ..., "-o"])
flags=$(grep -o '\.args(\["--ptx"[^]]*\])' "$repo/build-support/ptx.rs" | grep -o '"[^"]*"' | tr -d '"' | grep -vx -- -o)
[ -n "$flags" ] || { echo "gpu-ptx: no nvcc flags found in build-support/ptx.rs" >&2; exit 1; }
mkdir -p "$dir"
for k in "${kernels[@]}"; do
    src=$repo/nn/kernels/$k.cu
    [ -f "$src" ] || { echo "gpu-ptx: no $src" >&2; exit 2; }
    # shellcheck disable=SC2086 # the flags, one word each
    nvcc $flags -o "$dir/$k.ptx" "$src"
    echo "$dir/$k.ptx ($(wc -c <"$dir/$k.ptx") bytes, nvcc $(echo $flags))"
done
