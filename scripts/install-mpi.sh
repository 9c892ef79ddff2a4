#!/usr/bin/env bash
# What the `mpi` feature needs on a fresh Debian/Ubuntu machine: OpenMPI (mpirun, mpicc and its
# headers, which the mpi-sys crate's build asks for the compile and link flags) and libclang
# (bindgen reads mpi.h with it). Idempotent; needs root and apt-get. Prints what is missing and
# exits 1 where it cannot install.
set -euo pipefail
have() {
    command -v mpirun >/dev/null && command -v mpicc >/dev/null &&
        ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1
}
if have; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-mpi: OpenMPI (openmpi-bin, libopenmpi-dev) and libclang-dev are missing, and this is not root with apt-get: install them with your package manager" >&2
    exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev libclang-dev >/dev/null
have
