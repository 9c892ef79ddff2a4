#!/usr/bin/env bash
# The long elastic soak of issue 20 (CI runs a short one): a 4-rank job with --max_restarts 5,
# a rank SIGKILLed every 30-60 s, five times; the job must finish with the losses and final
# weights of an uninterrupted run. About 15 minutes here. Override any of:
#   DS_RS_SOAK_STEPS (40000), DS_RS_SOAK_KILLS (5), DS_RS_SOAK_GAP_S (30-60), DS_RS_SOAK_SEED.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_RS_SOAK_STEPS="${DS_RS_SOAK_STEPS:-40000}"
export DS_RS_SOAK_KILLS="${DS_RS_SOAK_KILLS:-5}"
export DS_RS_SOAK_GAP_S="${DS_RS_SOAK_GAP_S:-30-60}"
cargo test --release --test elastic_soak -- --nocapture 2>&1 | grep -v '^\[rank0\] step\|^{'
