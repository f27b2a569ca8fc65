"""Stress the copy kernels for races on a GPU/NPU (runs as a small smoke under the CPU interpreter).

    python benchmarks/stress_memmove.py --tree build/fork --base-tree build/base-0.30.0rc2 --json out.json

1. Random pairs: batches of mixed left / exact / disjoint pairs (sizes 1 B .. 64 KiB, every
   alignment), >= 1e6 pairs in total, through batch_memmove's kernel; every batch checked against
   numpy memmove applied in pair order to a byte snapshot of the pool (the whole pool, so bytes
   outside the destinations must be unchanged). No right overlaps: no Mamba move has one, and the
   memmove backend refuses them on the host (validate_copy_batch) before anything is launched.
2. Long copies, small left shifts: 2048 rows of 32 KiB shifted left by 1..64 bytes, 4/8/16 warps,
   BLOCK 1024 and 8192 for the unguarded batch_memcpy_kernel of --base-tree (the control, expected
   to corrupt; left out without --base-tree),
   BLOCK 1024 for an upstream-style left guard and BLOCK 1024 / MEMMOVE_BLOCK for memmove (the
   kernel batch_memmove launches: batch_memcpy_kernel of the tree); corrupted rows counted per kernel.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.copy_paths import left_guard_kernel_factory  # noqa: E402

KINDS = ("left", "exact", "disjoint")


def random_batch(rng: random.Random, num_pairs: int, max_log2: int):
    """Pairs (src, dst, size) in disjoint arenas of one pool; kinds, sizes and alignments mixed."""
    pairs, end = [], 0
    for _ in range(num_pairs):
        kind = rng.choice(KINDS)
        size = max(1, int(2 ** rng.uniform(0, max_log2)))
        align = rng.choice((1, 2, 4, 8, 16, 16, 16, 64))
        size = max(align, size // align * align) if rng.random() < 0.7 else size
        if kind == "exact":
            shift = 0
        else:
            unit = rng.choice((1, 2, 4, 8, 16))
            shift = max(1, int(2 ** rng.uniform(0, np.log2(max(2, size))))) // unit * unit or unit
            if kind == "left":
                shift = min(shift, max(1, size - 1))
        start = -(-(end + rng.randrange(0, 64)) // align) * align
        if kind == "exact":
            pairs.append((start, start, size))
            end = start + size
        elif kind == "disjoint":
            pairs.append(
                (start, start + size + shift, size) if rng.random() < 0.5 else (start + size + shift, start, size)
            )
            end = start + 2 * size + shift
        else:  # left: dst < src < dst + size
            pairs.append((start + shift, start, size))
            end = start + size + shift
    rng.shuffle(pairs)
    return pairs, end + 64


def oracle(pool: np.ndarray, pairs) -> np.ndarray:
    out = pool.copy()
    for s, d, n in pairs:
        out[d : d + n] = out[s : s + n].copy()
    return out


def run_random(k, torch, device, total_pairs, batch_pairs, max_log2, seed, num_warps, product=False):
    rng = random.Random(seed)
    done = bad_pairs = bad_outside = batches = 0
    t0 = time.time()
    while done < total_pairs:
        pairs, end = random_batch(rng, batch_pairs, max_log2)
        pool = np.frombuffer(rng.randbytes(end), dtype=np.uint8).copy()
        dev = torch.from_numpy(pool.copy()).to(device)
        base = dev.data_ptr()
        src = torch.tensor([base + s for s, _, _ in pairs], dtype=torch.int64, device=device)
        dst = torch.tensor([base + d for _, d, _ in pairs], dtype=torch.int64, device=device)
        sizes = torch.tensor([n for _, _, n in pairs], dtype=torch.int32, device=device)
        if product:  # vllm-ascend's launcher, with its own (Ascend) defaults
            k["memmove_module"].batch_memmove(src, dst, sizes)
        else:
            k["batch_memmove"](src, dst, sizes, num_warps=num_warps)
        common.synchronize(device)
        got = dev.cpu().numpy()
        want = oracle(pool, pairs)
        if not np.array_equal(got, want):
            covered = np.zeros(end, dtype=bool)
            for s, d, n in pairs:
                covered[d : d + n] = True
                if not np.array_equal(got[d : d + n], want[d : d + n]):
                    bad_pairs += 1
            bad_outside += int((got[~covered] != pool[~covered]).sum())
        done += len(pairs)
        batches += 1
    return {
        "test": "random_pairs",
        "pairs": done,
        "batches": batches,
        "pairs_per_batch": batch_pairs,
        "max_size": 2**max_log2,
        "num_warps": num_warps,
        "launcher": "batch_memmove (product defaults)" if product else "benchmark parameters",
        "mismatched_pairs": bad_pairs,
        "changed_bytes_outside_destinations": bad_outside,
        "seconds": round(time.time() - t0, 1),
        "kinds": list(KINDS),
    }


def rows_pool(torch, device, rows, row_bytes, shift, seed):
    stride = row_bytes + shift + 256
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, size=rows * stride, dtype=np.uint8)
    return pool, stride


def run_rows(k, torch, device, kernel_name, direction, rows, row_bytes, shift, block, num_warps, trials, seed):
    """Corrupted rows of `trials` launches over `rows` same-row shifts (left: dst = src - shift)."""
    pool, stride = rows_pool(torch, device, rows, row_bytes, shift, seed)
    starts = np.arange(rows, dtype=np.int64) * stride + 128
    if direction == "left":
        src_off, dst_off = starts + shift, starts
    else:
        src_off, dst_off = starts, starts + shift
    want = pool.copy()
    for s, d in zip(src_off, dst_off):
        want[d : d + row_bytes] = want[s : s + row_bytes].copy()
    want_dev = torch.from_numpy(want).to(device)
    pristine = torch.from_numpy(pool).to(device)
    dev = torch.empty_like(pristine)
    base = dev.data_ptr()
    src = torch.from_numpy(src_off + base).to(device)
    dst = torch.from_numpy(dst_off + base).to(device)
    sizes = torch.full((rows,), row_bytes, dtype=torch.int32, device=device)
    corrupted_rows = 0
    corrupted_trials = 0
    for _ in range(trials):
        dev.copy_(pristine)
        if kernel_name == "memmove":
            k["batch_memmove"](src, dst, sizes, block_size=block, num_warps=num_warps)
        elif kernel_name == "unguarded":
            k["batch_memcpy_unguarded"][(rows,)](src, dst, sizes, BLOCK_SIZE=block, num_warps=num_warps)
        elif kernel_name == "left_guard":
            k["left_guard"][(rows,)](src, dst, sizes, BLOCK_SIZE=block, num_warps=num_warps)
        common.synchronize(device)
        diff = dev != want_dev
        if bool(diff.any()):
            corrupted_trials += 1
            idx = torch.from_numpy(dst_off).to(device)
            # a row is corrupted when any byte of its destination differs
            row_bad = torch.zeros(rows, dtype=torch.bool, device=device)
            chunk = 256
            for c in range(0, row_bytes, chunk):
                offs = idx[:, None] + torch.arange(c, min(c + chunk, row_bytes), device=device)[None, :]
                row_bad |= diff[offs].any(dim=1)
            corrupted_rows += int(row_bad.sum())
    return {
        "test": f"{direction}_rows",
        "kernel": kernel_name,
        "rows": rows,
        "row_bytes": row_bytes,
        "shift": shift,
        "block": block,
        "num_warps": num_warps,
        "trials": trials,
        "corrupted_trials": corrupted_trials,
        "corrupted_rows": corrupted_rows,
        "rows_total": rows * trials,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree")
    parser.add_argument("--base-tree", help="an unpatched tree: its batch_memcpy_kernel is the unguarded control")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--batch-pairs", type=int, default=4096)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    k = common.setup_kernels(args.tree, base_tree=args.base_tree)
    import torch

    k["left_guard"] = left_guard_kernel_factory()
    device = common.select_device(args.device)
    smoke = args.smoke or device == "cpu"
    meta = {"device": common.device_name(device), "versions": common.versions(), "date": common.now()}
    results = []

    def log(rec):
        rec.update(meta)
        results.append(rec)
        print(json.dumps({key: v for key, v in rec.items() if key not in ("versions",)}), flush=True)

    if smoke:
        log(run_random(k, torch, device, 200, 50, 10, 0, None))
        log(run_random(k, torch, device, 200, 50, 10, 1, None, product=True))
        log(run_rows(k, torch, device, "memmove", "left", 4, 3000, 1, 1024, 4, 1, 0))
        if k["batch_memcpy_unguarded"]:
            # The interpreter cannot show a race, but it shows a wrong block order: a forward walk over
            # a right overlap longer than a block corrupts it, so the smoke's control still goes wrong.
            log(run_rows(k, torch, device, "unguarded", "right", 4, 3000, 16, 1024, 4, 1, 0))
    else:
        default_block = common.MEMMOVE_BLOCK
        for i, warps in enumerate((4, 8, 16)):
            share = args.pairs // 3 + (1 if i < args.pairs % 3 else 0)
            log(run_random(k, torch, device, share, args.batch_pairs, 16, 100 + i, warps))
        log(run_random(k, torch, device, max(1, args.pairs // 10), args.batch_pairs, 16, 99, None, product=True))
        for warps in (4, 8, 16):
            for shift in (1, 2, 4, 8, 16, 32, 64):
                controls = (("unguarded", 1024), ("unguarded", 8192)) if k["batch_memcpy_unguarded"] else ()
                for name, block in (
                    *controls,
                    ("memmove", 1024),
                    ("memmove", default_block),
                    ("left_guard", 1024),
                ):
                    log(
                        run_rows(
                            k, torch, device, name, "left", 2048, 32 * 1024, shift, block, warps, args.trials, shift
                        )
                    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    memmove_bad = sum(
        r.get("mismatched_pairs", 0)
        + r.get("changed_bytes_outside_destinations", 0)
        + (r.get("corrupted_rows", 0) if r.get("kernel") == "memmove" else 0)
        for r in results
    )
    print(f"stress: memmove mismatches {memmove_bad}")
    return 1 if memmove_bad else 0


if __name__ == "__main__":
    sys.exit(main())
