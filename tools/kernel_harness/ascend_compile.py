"""Compile the series' Triton kernels with triton-ascend's front end, on a CPU with no NPU.

    python -m tools.kernel_harness.ascend_compile --tree build/fork

`triton.compile(ASTSource(...), target=GPUTarget("npu", "Ascend910B3", 0))`
lowers each kernel to TTIR, runs `triton-adapter-opt` (TTIR -> Linalg/HIVM) and
stops at `ConvertLinalgRToBinary` with "ASCEND_HOME_PATH is not set": the
binary step needs the CANN toolkit. Reaching that stop with a `.ttadapter`
written means the Ascend front end accepted the kernel (OK). Any earlier error
(e.g. the `idx < size()` assertion a pointer cast inside a loop triggers) is a
FAIL. One line per kernel; the exit status is non-zero when any kernel fails.

Runs itself inside build/ascend-venv (created on first use, see envs.py): the
triton-ascend package replaces upstream's `triton`. Each kernel compiles in its
own process with a fresh Triton cache, so a crash or a cached result cannot hide
a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = ("npu", "Ascend910B3", 0)
STOP_STAGE = "ConvertLinalgRToBinary"
STOP_MESSAGE = "ASCEND_HOME_PATH is not set"

BATCH_COPY_SIG = {"src_ptrs": "*i64", "dst_ptrs": "*i64", "sizes": "*i32", "BLOCK_SIZE": "constexpr"}
POSTPROCESS_SIG = {
    "num_accepted_tokens_ptr": "*i32",
    "mamba_state_idx_ptr": "*i32",
    "num_scheduled_tokens_ptr": "*i32",
    "num_computed_tokens_ptr": "*i32",
    "num_draft_tokens_ptr": "*i32",
    "block_table_ptrs_ptr": "*i64",
    "block_table_stride_req": "i64",
    "state_base_addrs_ptr": "*i64",
    "state_block_strides_ptr": "*i64",
    "state_elem_sizes_ptr": "*i32",
    "state_inner_sizes_ptr": "*i64",
    "state_conv_widths_ptr": "*i32",
    "state_group_indices_ptr": "*i32",
    "num_accepted_tokens_out_ptr": "*i32",
    "num_reqs": "i32",
    "block_size": "constexpr",
    "COPY_BLOCK_SIZE": "constexpr",
}

# Arguments newer releases added to postprocess_mamba_fused_kernel (0.27.1rc1 on: DS conv rows,
# idx mapping, tiled temporal copies). compile_one takes what the kernel file declares.
POSTPROCESS_EXTRA_SIG = {
    "state_dim_row_count_ptr": "*i32",
    "state_dim_row_stride_ptr": "*i64",
    "idx_mapping_ptr": "*i32",
    "CONV_STATE_DIM_FIRST": "constexpr",
    "HAS_IDX_MAPPING": "constexpr",
    "PRECOMPUTED_NEW_COMPUTED": "constexpr",
    "TEMPORAL_TILES": "constexpr",
}
POSTPROCESS_EXTRA_CONSTS = {
    "CONV_STATE_DIM_FIRST": False,
    "HAS_IDX_MAPPING": False,
    "PRECOMPUTED_NEW_COMPUTED": False,
    "TEMPORAL_TILES": 1,
}

# The V2 precopy kernel (0.27.1rc1 on); the fork's imports postprocess's temporal copy.
PRECOPY_SIG = {
    "mamba_state_idx_ptr": "*i32",
    "src_col_ptr": "*i32",
    "token_bias_ptr": "*i32",
    **{k: v for k, v in POSTPROCESS_SIG.items() if k.startswith(("block_table", "state_"))},
    "state_dim_row_count_ptr": "*i32",
    "state_dim_row_stride_ptr": "*i64",
    "idx_mapping_ptr": "*i32",
    "num_reqs": "i32",
    "COPY_BLOCK_SIZE": "constexpr",
    "CONV_STATE_DIM_FIRST": "constexpr",
    "HAS_IDX_MAPPING": "constexpr",
    "TEMPORAL_TILES": "constexpr",
}
PRECOPY_CONSTS = {"COPY_BLOCK_SIZE": 1024, "CONV_STATE_DIM_FIRST": False, "HAS_IDX_MAPPING": False, "TEMPORAL_TILES": 1}

# Kernel files only some releases have (V2 model runner: 0.27.1rc1 on): SKIP where absent.
RELEASE_DEPENDENT = {"v2/mamba/precopy.py"}

# (label, module under vllm_ascend/ops/triton, kernel, signature, constexprs)
KERNELS = [
    (
        "postprocess_mamba_fused_kernel",
        "mamba/postprocess.py",
        "postprocess_mamba_fused_kernel",
        POSTPROCESS_SIG,
        {"block_size": 16, "COPY_BLOCK_SIZE": 1024},
    ),
    (
        "postprocess_mamba_fused_kernel (DS conv rows)",
        "mamba/postprocess.py",
        "postprocess_mamba_fused_kernel",
        POSTPROCESS_SIG,
        {"block_size": 16, "COPY_BLOCK_SIZE": 1024, "CONV_STATE_DIM_FIRST": True},
    ),
    (
        "postprocess_mamba_fused_kernel (DS conv rows, 4 temporal tiles)",
        "mamba/postprocess.py",
        "postprocess_mamba_fused_kernel",
        POSTPROCESS_SIG,
        {"block_size": 16, "COPY_BLOCK_SIZE": 1024, "CONV_STATE_DIM_FIRST": True, "TEMPORAL_TILES": 4},
    ),
    (
        "precopy_mamba_align_fused_kernel",
        "v2/mamba/precopy.py",
        "precopy_mamba_align_fused_kernel",
        PRECOPY_SIG,
        PRECOPY_CONSTS,
    ),
    (
        "precopy_mamba_align_fused_kernel (DS conv rows)",
        "v2/mamba/precopy.py",
        "precopy_mamba_align_fused_kernel",
        PRECOPY_SIG,
        {**PRECOPY_CONSTS, "CONV_STATE_DIM_FIRST": True, "HAS_IDX_MAPPING": True, "TEMPORAL_TILES": 4},
    ),
    # the pointer kernel of VLLM_ASCEND_MAMBA_COPY_BACKEND=triton and =memmove (batch_memmove launches it)
    ("batch_memcpy_kernel", "batch_memcpy.py", "batch_memcpy_kernel", BATCH_COPY_SIG, {"BLOCK_SIZE": 8192}),
]


def _in_ascend_env() -> bool:
    try:
        import triton.backends.ascend  # noqa: F401
    except ImportError:
        return False
    return True


def _find(roots: list[Path], rel: str) -> Path | None:
    for root in roots:
        path = root / "vllm_ascend" / "ops" / "triton" / rel
        if path.is_file():
            return path
    return None


def compile_one(path: str, kernel: str, signature: dict, constexprs: dict, roots: list) -> dict:
    """Child process: compile one kernel; returns {status, stage, detail, artifacts}."""
    cache = tempfile.mkdtemp(prefix="ascend-compile-")
    os.environ["TRITON_CACHE_DIR"] = cache
    sys.path.insert(0, str(ROOT))
    from tools.kernel_harness import loader

    loader.provide_triton_utils()
    # The kernel's own tree first: its imports of the tree (postprocess's temporal copy, vllm_ascend.utils:
    # the stub) resolve there.
    own = loader.tree_root(Path(path))
    loader.register_tree(list(dict.fromkeys([*([own] if own else []), *(Path(r).resolve() for r in roots)])))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = loader.load_file(Path(path), f"_ascend_compile_{kernel}")
    fn = getattr(module, kernel)
    names = list(fn.arg_names)
    absent = [name for name in constexprs if name not in names]
    if absent:
        return {
            "status": "SKIP",
            "stage": "",
            "detail": f"this kernel file has no {', '.join(absent)}",
            "artifacts": [],
        }
    if signature is not None and set(names) != set(signature):  # the kernel's own argument list, in order
        known = {**POSTPROCESS_EXTRA_SIG, **signature}
        signature = {name: known[name] for name in names}
        constexprs = {**{k: v for k, v in POSTPROCESS_EXTRA_CONSTS.items() if k in names}, **constexprs}
    src = ASTSource(fn, dict(signature), constants=dict(constexprs))
    try:
        triton.compile(src, target=GPUTarget(*TARGET))
        error = None
    except Exception as exc:  # MLIRCompilationError and friends
        error = f"{type(exc).__name__}: {exc}"
    artifacts = sorted(p.name for p in Path(cache).rglob("*") if p.suffix in (".ttir", ".ttadapter"))
    shutil.rmtree(cache, ignore_errors=True)
    if error is None:
        return {
            "status": "OK",
            "stage": "binary",
            "detail": "compiled to a binary (CANN present)",
            "artifacts": artifacts,
        }
    stage = ""
    for line in error.splitlines():
        if "encounters error" in line:
            stage = line.strip().strip("[").split("]")[0]
            break
    reached_stop = STOP_STAGE in error and STOP_MESSAGE in error
    if reached_stop and any(a.endswith(".ttadapter") for a in artifacts):
        return {
            "status": "OK",
            "stage": stage,
            "detail": f"front end passed; stopped at {STOP_STAGE} (no CANN)",
            "artifacts": artifacts,
        }
    detail = " | ".join(line.strip() for line in error.splitlines() if line.strip() and "BEG]" not in line)
    return {"status": "FAIL", "stage": stage or "?", "detail": detail[:600], "artifacts": artifacts}


def _run_child(path: Path, kernel: str, signature: dict, constexprs: dict, roots: list) -> dict:
    payload = json.dumps([str(path), kernel, signature, constexprs, [str(r) for r in roots]])
    proc = subprocess.run(
        [sys.executable, "-m", "tools.kernel_harness.ascend_compile", "--child", payload],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {
        "status": "FAIL",
        "stage": "crash",
        "detail": f"exit {proc.returncode}: {' | '.join(tail)}",
        "artifacts": [],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tree", action="append", default=[], help="vllm-ascend tree(s); first wins (default build/fork)"
    )
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="FILE:KERNEL",
        help="also compile KERNEL from FILE with the batch-copy signature (src_ptrs, dst_ptrs, sizes, BLOCK_SIZE)",
    )
    parser.add_argument("--only", action="append", default=[], help="compile only kernels whose label starts so")
    parser.add_argument("--allow-missing", action="store_true", help="skip kernels whose file the tree lacks")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if not _in_ascend_env():
        from tools.kernel_harness import envs

        python = envs.ensure("ascend")
        argv_out = [
            str(python),
            "-m",
            "tools.kernel_harness.ascend_compile",
            *(argv if argv is not None else sys.argv[1:]),
        ]
        return subprocess.run(argv_out, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode

    if args.child:
        print(json.dumps(compile_one(*json.loads(args.child))))
        return 0

    roots = [Path(t).resolve() for t in (args.tree or [str(ROOT / "build" / "fork")])]
    jobs = []
    for label, rel, kernel, sig, consts in KERNELS:
        if args.only and not any(label.startswith(o) for o in args.only):
            continue
        jobs.append((label, _find(roots, rel), rel, kernel, sig, consts))
    for extra in args.extra:
        file, _, kernel = extra.rpartition(":")
        path = Path(file).resolve()
        jobs.append(
            (
                f"{kernel} ({path.name})",
                path if path.is_file() else None,
                file,
                kernel,
                BATCH_COPY_SIG,
                {"BLOCK_SIZE": 4096},
            )
        )

    failed = skipped = 0
    for label, path, rel, kernel, sig, consts in jobs:
        if path is None:
            if args.allow_missing or rel in RELEASE_DEPENDENT:
                skipped += 1
                print(f"SKIP {label}: {rel} not in {', '.join(map(str, roots))}")
                continue
            failed += 1
            print(f"FAIL {label}: {rel} not found in {', '.join(map(str, roots))}")
            continue
        result = _run_child(path, kernel, sig, consts, roots)
        skipped += result["status"] == "SKIP"
        if result["status"] not in ("OK", "SKIP"):
            failed += 1
        print(f"{result['status']} {label} [{path}]: {result['detail']}")
    import triton

    print(
        f"ascend_compile: {len(jobs) - failed - skipped} ok, {skipped} skipped, {failed} failed "
        f"(triton-ascend {triton.__version__}, "
        f"target {TARGET[0]}/{TARGET[1]})"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
