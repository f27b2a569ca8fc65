#!/usr/bin/env bash
# One device session: op tests, stress runs, align-mode trace stress and the benchmark.
#
#   bash benchmarks/device_run.sh OUTDIR [tests] [memmove] [groups] [stress] [bench] [micro] [trace] [fused_tests] [fused_stress] [fused_bench] [trace_seconds=N]
#   (BENCH_ARGS: extra copy_paths.py arguments, e.g. --sweep or --backends ...)
#
# Run from a tree laid out like this repository (tools/kernel_harness, benchmarks/, the overlay)
# with build/fork (the materialized series) and build/base (the pinned base, for the controls);
# The fused_* phases also test and time build/main's kernels when that tree is there (an earlier series).
# Every phase writes its log / JSON into OUTDIR and runs under a time limit, so partial results
# survive. Needs torch + triton (+ pytest, hypothesis); no vLLM. The fused kernels' op test is written
# for an NPU (device "npu"): benchmarks/npu_as_cuda.py maps it to the GPU.
set -u
OUT=${1:?usage: device_run.sh OUTDIR phases...}
shift
mkdir -p "$OUT"
TRACE_SECONDS=240
PHASES=()
for arg in "$@"; do
    case "$arg" in
        trace_seconds=*) TRACE_SECONDS=${arg#trace_seconds=} ;;
        *) PHASES+=("$arg") ;;
    esac
done
OPS=tests/e2e/nightly/single_node/ops/singlecard_ops/triton
PY=${PYTHON:-python}
status=0

{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
    $PY -c "import torch, triton, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'numpy', numpy.__version__)"
    $PY -c "import hypothesis, pytest; print('hypothesis', hypothesis.__version__, 'pytest', pytest.__version__)" || true
} >"$OUT/env.txt" 2>&1

for phase in "${PHASES[@]}"; do
    case "$phase" in
        tests)
            # The series' op tests on the device (fork tree), with a longer fuzz budget.
            KERNEL_FUZZ_EXAMPLES=${KERNEL_FUZZ_EXAMPLES:-400} timeout 300 $PY -m pytest -p tools.kernel_harness.plugin \
                -p benchmarks.npu_as_cuda --noconftest --kernel-tree build/fork -v -p no:cacheprovider \
                --junitxml "$OUT/tests_fork.xml" build/fork/$OPS/test_batch_memmove.py \
                build/fork/$OPS/test_mamba_state_copy.py >"$OUT/tests_fork.log" 2>&1 || status=1
            tail -3 "$OUT/tests_fork.log"
            # Revert proof: the same fused-kernel test against the base tree's kernels.
            timeout 180 $PY -m pytest -p tools.kernel_harness.plugin -p benchmarks.npu_as_cuda --noconftest --kernel-tree build/base -v \
                -p no:cacheprovider --junitxml "$OUT/tests_base_postprocess.xml" \
                build/fork/$OPS/test_mamba_state_copy.py >"$OUT/tests_base_postprocess.log" 2>&1
            echo "base tree (unguarded) postprocess test exit: $? (expected non-zero)"
            tail -3 "$OUT/tests_base_postprocess.log"
            ;;
        memmove)
            # The memmove kernel on the device against its numpy memmove oracle, through vllm-ascend's
            # launcher (its defaults) and with the benchmarks' GPU parameters: a shorter `stress` phase.
            timeout 300 $PY benchmarks/stress_memmove.py --pairs 100000 --trials 2 --json "$OUT/memmove_check.json" \
                >"$OUT/memmove_check.log" 2>&1 || status=1
            tail -1 "$OUT/memmove_check.log"
            ;;
        groups)
            # The grouped copy's oracle tests on the device as they are (must pass), then with each of
            # benchmarks/mutations.py's breakages (each must fail): "mutation NAME: N failed, M passed".
            GROUPS_TEST=(-p tools.kernel_harness.plugin -p benchmarks.vllm_copy_specs --noconftest --kernel-tree build/fork
                build/fork/tests/ut/worker/test_mamba_copy_groups.py)
            timeout 540 $PY benchmarks/mutations.py -- "${GROUPS_TEST[@]}" >"$OUT/tests_groups.log" 2>&1 || status=1
            cat "$OUT/tests_groups.log"
            ;;
        stress)
            timeout 300 $PY benchmarks/stress_memmove.py --json "$OUT/stress_memmove.json" \
                >"$OUT/stress_memmove.log" 2>&1 || status=1
            tail -1 "$OUT/stress_memmove.log"
            ;;
        bench)
            timeout 400 $PY benchmarks/copy_paths.py ${BENCH_ARGS:-} --json "$OUT/copy_paths.json" \
                --png "$OUT/copy_paths.png" >"$OUT/copy_paths.log" 2>&1 || status=1
            grep -v '^host' "$OUT/copy_paths.log" | tail -40
            ;;
        micro)
            # The torch ops a grouped copy is built from: view building, one multi-tensor copy, row-index ops.
            timeout 200 $PY benchmarks/copy_ops_micro.py --json "$OUT/copy_ops_micro.json" >"$OUT/copy_ops_micro.log" 2>&1 \
                || status=1
            tail -4 "$OUT/copy_ops_micro.log"
            ;;
        trace)
            timeout $((TRACE_SECONDS + 120)) $PY benchmarks/align_trace_stress.py --seconds "$TRACE_SECONDS" \
                --backends unguarded,memmove,torch,dropcopy --json "$OUT/align_trace.json" \
                >"$OUT/align_trace.log" 2>&1 || status=1
            tail -1 "$OUT/align_trace.log"
            ;;
        fused_tests)
            # The fused postprocess / precopy kernels' shared copy body: its op tests on the fork, and the same
            # tests against the base (and build/main) as controls, expected to fail. The controls run the precopy
            # tests in a process of their own: the base precopy kernel's misaligned u64 access is a sticky CUDA
            # error that would fail every later test of its process.
            timeout 240 $PY -m pytest -p tools.kernel_harness.plugin -p benchmarks.npu_as_cuda --noconftest \
                --kernel-tree build/fork -q -rf -p no:cacheprovider build/fork/$OPS/test_mamba_state_copy.py >"$OUT/fused_tests_fork.log" 2>&1 || status=1
            echo "fused op tests on fork: $(tail -1 "$OUT/fused_tests_fork.log")"
            for tree in base main; do
                [ -d "build/$tree" ] || continue
                for part in "not precopy" precopy; do
                    log="$OUT/fused_tests_${tree}_${part/not /no}.log"
                    timeout 120 $PY -m pytest -p tools.kernel_harness.plugin -p benchmarks.npu_as_cuda --noconftest \
                        --kernel-tree "build/$tree" -q -rf -p no:cacheprovider -k "$part" build/fork/$OPS/test_mamba_state_copy.py >"$log" 2>&1
                    echo "fused op tests on $tree (-k '$part'): $(tail -1 "$log") (expected failures)"
                done
            done
            ;;
        fused_stress)
            # The fused postprocess kernel's in-place conv shift under real concurrency (long rows, small shifts,
            # 4 and 16 warps, 1 and 4 tiles), on the fork; the base (and build/main) as controls, expected to fail.
            timeout 300 $PY benchmarks/stress_fused.py --tree build/fork --json "$OUT/fused_stress_fork.json" \
                >"$OUT/fused_stress_fork.log" 2>&1
            rc=$?; [ $rc -eq 0 ] || status=1
            echo "fused stress on fork: exit $rc"; tail -16 "$OUT/fused_stress_fork.log"
            for tree in base main; do
                [ -d "build/$tree" ] || continue
                timeout 300 $PY benchmarks/stress_fused.py --tree "build/$tree" --json "$OUT/fused_stress_$tree.json" \
                    >"$OUT/fused_stress_$tree.log" 2>&1
                echo "fused stress on $tree: exit $? (expected non-zero)"; grep -v ' 0 of ' "$OUT/fused_stress_$tree.log" | tail -16
            done
            ;;
        fused_bench)
            compare=(--compare base=build/base/vllm_ascend/ops/triton/mamba/postprocess.py)
            [ -d build/main ] && compare+=(--compare main=build/main/vllm_ascend/ops/triton/mamba/postprocess.py)
            timeout 300 $PY benchmarks/fused_copy.py --tree build/fork "${compare[@]}" \
                --precopy-base build/base/vllm_ascend/ops/triton/v2/mamba/precopy.py --json "$OUT/fused_copy.json" \
                >"$OUT/fused_copy.log" 2>&1 || status=1
            cat "$OUT/fused_copy.log"
            ;;
        *) echo "unknown phase $phase"; status=2 ;;
    esac
done
exit $status
