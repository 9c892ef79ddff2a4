#!/usr/bin/env bash
# The longer run of the fuzz tests: every parser of outside bytes (ds_config, hostfiles and
# --include/--exclude, the store's and a rank's peer port, checkpoint manifests and shard
# headers, --init weights files, token files, DeepSpeed checkpoints and their pickles) with PROPTEST_CASES cases per property instead of
# the few hundred `cargo test` runs. PROPTEST_CASES=N scripts/fuzz.sh sets the count.
set -euo pipefail
cd "$(dirname "$0")/.."
export PROPTEST_CASES="${PROPTEST_CASES:-20000}"
# Debug builds: integer overflow panics there, so an overflow on hostile input is caught.
cargo test -p ds-config --test fuzz
cargo test -p ds-comm --test fuzz_wire
cargo test -p ds-comm --lib mesh::tests
cargo test -p ds-engine --test fuzz_files
cargo test -p ds-rs --bin ds-rs launch::hosts::fuzz
