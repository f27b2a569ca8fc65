#!/usr/bin/env bash
# Stage what benchmarks/device_run.sh needs into DEST (a folder inside this repository that git ignores, e.g. .devrun/kernel, so that a device run can carry it):
# the harness, the benchmarks, the overlay, and the kernel/test files of build/fork and build/base.
set -eu
DEST=${1:?usage: stage_devrun.sh DEST}
SRC=$(cd "$(dirname "$0")/.." && pwd)
OPS=tests/e2e/nightly/single_node/ops/singlecard_ops/triton
rm -rf "$DEST"
mkdir -p "$DEST/tools/kernel_harness" "$DEST/benchmarks"
cp "$SRC/tools/__init__.py" "$DEST/tools/"
cp "$SRC"/tools/kernel_harness/*.py "$DEST/tools/kernel_harness/"
cp "$SRC"/benchmarks/*.py "$SRC"/benchmarks/*.sh "$DEST/benchmarks/"
# The unpatched pin: build/base-<pin> (`python -m tools.fork apply --base-only`), else build/base.
PIN=$(sed -n 's/^version = "\(.*\)"/\1/p' "$SRC/fork.toml" | head -1)
for tree in fork base; do
    from=$tree
    if [ "$tree" = base ] && [ -d "$SRC/build/base-$PIN" ]; then from=base-$PIN; fi
    for f in vllm_ascend/ops/triton/batch_memcpy.py vllm_ascend/ops/triton/batch_memmove.py \
             vllm_ascend/ops/triton/mamba/postprocess.py vllm_ascend/ops/triton/mamba/state_copy.py \
             vllm_ascend/ops/triton/v2/mamba/precopy.py vllm_ascend/worker/mamba_copy_checks.py \
             vllm_ascend/worker/mamba_copy_groups.py \
             tests/ut/worker/test_mamba_copy_groups.py \
             $OPS/test_batch_memmove.py $OPS/test_precopy.py $OPS/test_postprocess_temporal_copy.py; do
        if [ -f "$SRC/build/$from/$f" ]; then
            mkdir -p "$DEST/build/$tree/$(dirname "$f")"
            cp "$SRC/build/$from/$f" "$DEST/build/$tree/$f"
        fi
    done
done
mkdir -p "$DEST/vllm_ascend/ops/triton" "$DEST/vllm_ascend/worker" "$DEST/tests/ut/worker"
cp "$SRC/vllm_ascend/ops/triton/batch_memmove.py" "$DEST/vllm_ascend/ops/triton/"
# The torch-only grouped copy modules and their oracle tests (they run on the device they find).
cp "$SRC/vllm_ascend/worker/mamba_copy_groups.py" "$SRC/vllm_ascend/worker/mamba_copy_checks.py" "$DEST/vllm_ascend/worker/"
cp "$SRC/tests/ut/worker/test_mamba_copy_groups.py" "$DEST/tests/ut/worker/"
find "$DEST" -type f | wc -l
