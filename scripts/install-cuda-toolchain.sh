#!/usr/bin/env bash
# The CUDA 13.0 build toolchain for `--features cuda` (the recipe of the team's shared/gpu, kept here
# so that a fresh clone needs nothing beside it): nvcc, headers and libraries from PyPI wheels,
# laid out as a CUDA_HOME, on a machine with no GPU. scripts/check-cuda.sh runs it.
# Install a CUDA 13.0 *build* toolchain (nvcc, headers, link-time libraries)
# from PyPI wheels, on a machine with no GPU and no CUDA toolkit, and lay it
# out as a CUDA_HOME-like folder that candle-kernels (cudaforge) and cudarc's
# build scripts understand.
#
# Idempotent: re-running with the same pins only re-checks the layout.
# Usage:   nice -n 19 bash setup-cuda-toolchain.sh [--print-env]
#          eval "$(bash setup-cuda-toolchain.sh --print-env)"   # export the env
# Env:     CUDA_PIP_PREFIX  install prefix (default /opt/cuda-pip; keep it
#                           outside any git repository)
#          PYTHON           python3 used to create the venv (default python3)
#
# Needs: python3 with venv+pip, gcc (for the libcuda link stub), network
# access to the Python package index. About 1.4 GiB on disk.
set -euo pipefail

PREFIX="${CUDA_PIP_PREFIX:-/opt/cuda-pip}"
PY="${PYTHON:-python3}"
CUDA="$PREFIX/cuda"

print_env() {
    cat <<EOF
export CUDA_HOME="$CUDA"
export CUDA_PATH="$CUDA"
export PATH="$CUDA/bin:\$PATH"
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-90}"
export CUDARC_CUDA_VERSION=13000
export CUDAFORGE_THREADS="\${CUDAFORGE_THREADS:-1}"
EOF
}

if [[ "${1:-}" == "--print-env" ]]; then
    print_env
    exit 0
fi

# Pins: everything on the CUDA 13.0 line. nvidia-cuda-nvcc does not pin its
# own nvvm/crt dependencies, so without the explicit pins below pip pulls the
# newest cicc (13.x > 13.0), whose PTX a 13.0 driver may reject.
# NCCL 2.28.9 is what the device machine's PyTorch (2.11, cu130) ships.
PINS=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
    nvidia-cuda-nvrtc==13.0.88
    nvidia-cuda-cupti==13.0.85
    nvidia-cublas==13.0.2.14
    nvidia-curand==10.4.0.35
    nvidia-nccl-cu13==2.28.9
)
STAMP="$PREFIX/.pins"

if [[ ! -x "$PREFIX/bin/pip" ]]; then
    "$PY" -m venv "$PREFIX"
fi
if [[ ! -f "$STAMP" ]] || [[ "$(cat "$STAMP")" != "${PINS[*]}" ]]; then
    "$PREFIX/bin/pip" install --quiet --disable-pip-version-check "${PINS[@]}"
    echo "${PINS[*]}" > "$STAMP"
fi

SP="$("$PREFIX/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia"
[[ -x "$SP/cu13/bin/nvcc" ]] || { echo "nvcc missing under $SP/cu13/bin" >&2; exit 1; }

# --- CUDA_HOME-like layout ---------------------------------------------------
# bin/ include/ nvvm/ : the wheel's folders (nvcc.profile resolves include/,
#                       include/cccl and nvvm/ relative to bin/..)
# lib64/              : libX.so and libX.so.N links to the wheels' libraries
# lib64/stubs/        : libcuda.so link stub (the driver is not on PyPI)
# stub-runtime/       : libcuda.so.1 = the same stub, ONLY for smoke runs on a
#                       machine with no driver; never on a GPU machine's path.
mkdir -p "$CUDA/lib64/stubs" "$CUDA/stub-runtime"
ln -sfn "$SP/cu13/bin" "$CUDA/bin"
ln -sfn "$SP/cu13/include" "$CUDA/include"
ln -sfn "$SP/cu13/nvvm" "$CUDA/nvvm"
for f in "$SP"/cu13/lib/lib* "$SP"/nccl/lib/lib*; do
    name="$(basename "$f")"
    ln -sfn "$f" "$CUDA/lib64/$name"
    case "$name" in
        *.so.*) ln -sfn "$f" "$CUDA/lib64/${name%%.so.*}.so" ;;
    esac
done

# libcuda link stub: every driver entry point named in cuda.h (raw names, and
# the _v2/_v3.../_ptds/_ptsz names the macros map them to), each returning
# CUDA_ERROR_STUB_LIBRARY (34). SONAME libcuda.so.1, as the real driver.
HDR="$CUDA/include/cuda.h"
STUB_SRC="$CUDA/lib64/stubs/libcuda-stub.c"
if [[ ! -f "$CUDA/lib64/stubs/libcuda.so" || "$HDR" -nt "$CUDA/lib64/stubs/libcuda.so" ]]; then
    {
        grep -oE 'CUDAAPI[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]*\(' "$HDR" \
            | sed -E 's/CUDAAPI[[:space:]]+//; s/[[:space:]]*\($//'
        for def in "" "-DCUDA_API_PER_THREAD_DEFAULT_STREAM=1"; do
            gcc -E -P $def -I"$CUDA/include" -x c "$HDR" \
                | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' \
                | sed -E 's/[[:space:]]*\($//'
        done
    } | sort -u | awk '{ printf "int %s(void) { return 34; }\n", $1 }' > "$STUB_SRC"
    gcc -shared -fPIC -O0 -Wl,-soname,libcuda.so.1 -o "$CUDA/lib64/stubs/libcuda.so" "$STUB_SRC"
fi
ln -sfn "$CUDA/lib64/stubs/libcuda.so" "$CUDA/stub-runtime/libcuda.so.1"

# --- checks -----------------------------------------------------------------
"$CUDA/bin/nvcc" --version | grep -q "release 13.0" \
    || { echo "unexpected nvcc version" >&2; "$CUDA/bin/nvcc" --version >&2; exit 1; }
for lib in libcudart.so libcublas.so libcublasLt.so libcurand.so libnvrtc.so libnccl.so stubs/libcuda.so; do
    [[ -e "$CUDA/lib64/$lib" ]] || { echo "missing $CUDA/lib64/$lib" >&2; exit 1; }
done
echo "# CUDA 13.0 build toolchain ready under $CUDA; export:" >&2
print_env
