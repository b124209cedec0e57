#!/usr/bin/env bash
# Developer loop on a GPU machine: scripts/gpu_round.sh with a fast Hopper-only build and
# nothing beyond what you ask for (no sanitizer, no benchmark unless named). Logs go to $OUT.
#
#   JAX_MILA_KERNELS=flash512 TESTS='tests/test_flash_attention.py -k d512' \
#   SANITIZE="memcheck racecheck" SANITIZE_OPS=d512 \
#   BENCH="benchmarks/attention.py --only d512" bash scripts/gpu_dev.sh
#
# TESTS are pytest arguments quoted as in a shell; SANITIZE_OPS picks op groups of
# scripts/sanitize_kernels.py; BENCH may hold several benchmark commands separated by ';'.
case "${1:-}" in -h|--help)  # the header above, without its "# "
  sed -n '2,/^case /{/^case /d; s/^# \{0,1\}//; p}' "$0"; exit 0 ;; esac
set -uo pipefail
export JAX_MILA_CUDA_ARCHS=${JAX_MILA_CUDA_ARCHS:-90a}
export SANITIZE=${SANITIZE:-}
export BENCHES=${BENCH:-}
exec bash "$(dirname "$0")/gpu_round.sh"
