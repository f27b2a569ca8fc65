#!/usr/bin/env bash
# CPU checks of the series' Triton kernels (no GPU/NPU needed):
#   1. the device-generic op tests under the Triton interpreter,
#   2. the harness's own tests (incl. the known-bad kernel that must fail to compile),
#   3. the triton-ascend front-end compile of every added/changed kernel.
# Usage: bash tools/kernel_harness/run_cpu.sh [TREE]   (TREE: a materialized fork, default build/fork)
# Environments are created on first use under build/ (see tools/kernel_harness/envs.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
TREE=${1:-build/fork}
OPS=tests/e2e/nightly/single_node/ops/singlecard_ops/triton
PY=$(python3 -m tools.kernel_harness.envs interp | tail -1)
"$PY" -m pytest -p tools.kernel_harness.plugin --noconftest -p no:cacheprovider --kernel-tree "$TREE" -q \
    "$TREE/$OPS/test_batch_memmove.py" "$TREE/$OPS/test_postprocess_mamba_overlap.py"
"$PY" -m pytest -p no:cacheprovider -q tools/kernel_harness/tests
python3 -m tools.kernel_harness.ascend_compile --tree "$TREE"
