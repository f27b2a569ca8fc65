"""A pinned copy table rewritten while its non-blocking H2D is still queued: the hazard and its control.

    python benchmarks/pinned_table_race.py --device cuda            # a GPU: the hazard shows
    python benchmarks/pinned_table_race.py --smoke                  # CPU: the script runs (no asynchrony)

torch only, no vLLM. It plays the order in which vllm-ascend 0.23.0.post1's model runner treats the
Mamba copy tables on its pointer path (docs/table-lifetime.md):

  step N    inside the input-prep window: the host writes the pinned tables (preprocess_mamba);
            the window's exit records the input-prep event;
            after the window: the device has other work queued (here torch.cuda._sleep), then the
            tables' non-blocking H2D (CpuGpuBuffer.copy_to_gpu) and the copy launch that reads the
            device table (here index_select + index_copy_ over a block pool);
  step N+1  the window's entry waits on that event, then the host rewrites the pinned tables.

"late" (the hazard): the event is recorded before the H2D is queued, as on 0.23.0.post1, so waiting
on it does not wait for the H2D, and the H2D reads step N+1's rows. "staged" (the control): the H2D
is queued before the event is recorded (0.30.0rc2 stages the tables inside the window), so the
rewrite waits for it. Each trial counts the destination bytes of step N's copy that differ from a
host oracle of step N's moves; a JSON record goes to stdout.
"""

import argparse
import json
import time

import torch

NUM_BLOCKS, BLOCK_BYTES, MOVES = 64, 4096, 8


def step_moves(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """MOVES distinct (source, destination) blocks: a step's rows of the copy table."""
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[: 2 * MOVES]
    return blocks[:MOVES], blocks[MOVES:]


def run_trial(order: str, device: torch.device, gen: torch.Generator, sleep_cycles: int) -> int:
    on_gpu = device.type == "cuda"
    pool = torch.randint(0, 256, (NUM_BLOCKS, BLOCK_BYTES), dtype=torch.uint8, generator=gen).to(device)
    host_table = torch.zeros(2, MOVES, dtype=torch.int64, pin_memory=on_gpu)  # the pinned tables
    device_table = torch.zeros(2, MOVES, dtype=torch.int64, device=device)
    event = torch.cuda.Event() if on_gpu else None
    src, dst = step_moves(gen)
    expected = pool.cpu()
    expected[dst] = expected[src]  # step N's moves, on the host

    host_table[0], host_table[1] = src, dst  # step N: the window writes the tables
    if order == "staged":
        device_table.copy_(host_table, non_blocking=True)
    if on_gpu:
        event.record()  # the window's exit
        torch.cuda._sleep(sleep_cycles)  # work queued ahead of the copy
    if order == "late":
        device_table.copy_(host_table, non_blocking=True)
    pool.index_copy_(0, device_table[1], pool.index_select(0, device_table[0]))  # the copy launch

    if on_gpu:
        event.synchronize()  # step N+1: the window's entry
    next_src, next_dst = step_moves(gen)
    host_table[0], host_table[1] = next_src, next_dst  # step N+1 rewrites the pinned tables
    if on_gpu:
        torch.cuda.synchronize()
    return int((pool.cpu()[dst] != expected[dst]).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--sleep-cycles", type=int, default=20_000_000, help="torch.cuda._sleep ahead of the H2D")
    parser.add_argument("--smoke", action="store_true", help="a few trials on the CPU")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else args.device)
    trials = 3 if args.smoke else args.trials
    gen = torch.Generator().manual_seed(0)
    record = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "trials": trials,
        "moves_per_step": MOVES,
        "block_bytes": BLOCK_BYTES,
        "sleep_cycles": args.sleep_cycles if device.type == "cuda" else 0,
    }
    for order in ("late", "staged"):
        start = time.perf_counter()
        wrong = [run_trial(order, device, gen, args.sleep_cycles) for _ in range(trials)]
        record[order] = {
            "trials_with_wrong_bytes": sum(w > 0 for w in wrong),
            "wrong_bytes": sum(wrong),
            "bytes_checked": trials * MOVES * BLOCK_BYTES,
            "seconds": round(time.perf_counter() - start, 3),
        }
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
