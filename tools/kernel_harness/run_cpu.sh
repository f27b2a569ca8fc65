#!/usr/bin/env bash
# CPU checks of the series' Triton kernels (no GPU/NPU needed): the device-generic op tests and the
# harness's own tests under the Triton interpreter, and the triton-ascend front-end compile.
# Same as the kernel steps of `make test`; environments are made on first use under build/.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 -m tools.fork test --kernels-only "$@"
