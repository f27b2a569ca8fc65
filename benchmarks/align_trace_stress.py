"""Align-mode trace stress: simulated scheduler steps through each Mamba state copy path.

    python benchmarks/align_trace_stress.py --json benchmarks/results/h200_run4/align_trace.json
    python benchmarks/align_trace_stress.py --smoke          # CPU interpreter, a few steps

A small model of vLLM's align mode (mamba_cache_mode="align", prefix caching, speculative
decoding) generates, step by step, the copies vLLM makes:

* preprocess (vLLM's `preprocess_mamba` + `collect_mamba_copy_meta`): a request whose running-state
  block index changed since the last step copies its state from the previous block:
  conv `state[b[prev], bias:] -> state[b[curr], :rows - bias]` (get_conv_copy_spec) and temporal
  `state[b[prev + bias]] -> state[b[curr]]` (get_temporal_copy_spec), bias = accepted - 1;
* the "model": writes new conv/temporal states into the running block and, for draft tokens, the
  speculative blocks after it (XOR with step-specific random bytes, so every earlier copy
  error propagates and stays visible);
* postprocess (the fused kernel's decision rule): when accepted tokens cross a block boundary the
  state at the boundary is copied into the boundary block; a same-block move is the overlapping
  conv shift `state[b, bias:] -> state[b, :rows - bias]`.

Backends (plus `dropcopy`, a checker self-test that silently drops one postprocess copy per step
and must be caught): `unguarded` (batch_memcpy_kernel BLOCK 8192 + the unguarded fused postprocess kernel
of the base tree: the control), `memmove` (batch_memmove + the guarded fused kernel), `torch`
(tensor pairs `dst.copy_(src.clone())` for both). A numpy reference applies the same copies with
memmove semantics; after every step every block of every pool is compared with it (and the
device pools are re-synchronised after a mismatch, so each counted mismatch is a fresh event).

Scenarios (from the seed's reproductions): two long concurrent requests then a second round
reusing their blocks; three concurrent requests; a 2000-token decode at high context; prefix
caching with shared source blocks; many concurrent requests with churn.
Geometries: `gdn_like` (conv 3+S rows x 2 KiB, temporal 8 KiB) and `adversarial` (conv 2048+S
rows x 16 B: ~32 KiB copies shifted by 16-48 B, the shape that races on GPUs).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402


def cdiv(a, b):
    return -(-a // b)


@dataclass
class Geometry:
    name: str
    conv_rows_base: int  # rows before the speculative extension
    conv_dim: int  # bf16 elements per row
    temporal_elems: int  # fp32 elements per block
    layers: int = 2
    num_blocks: int = 384


@dataclass
class Request:
    rid: int
    prompt: int
    output: int
    prefix_group: int | None = None
    prefix_blocks: int = 0
    block_ids: list = field(default_factory=list)
    shared: int = 0  # leading block ids borrowed from the prefix cache
    computed: int = 0
    generated: int = 0
    num_accepted: int = 1
    state_idx: int | None = None


def scenarios(scale: float, spec: int):
    """name -> (block_size, max_running, chunk, arrivals[(step, prompt, output, prefix_group, prefix_blocks)])."""
    s = max(scale, 0.01)

    def n(x):
        return max(2, int(x * s))

    rng = random.Random(7)
    out = {
        "two_long_then_reuse": (
            16,
            2,
            128,
            [
                (0, n(700), n(500), None, 0),
                (0, n(650), n(520), None, 0),
                (n(400), n(600), n(450), None, 0),
                (n(400), n(680), n(400), None, 0),
            ],
        ),
        "three_concurrent": (
            16,
            3,
            128,
            [(0, n(300), n(400), None, 0), (0, n(350), n(380), None, 0), (2, n(280), n(420), None, 0)],
        ),
        "long_decode_high_context": (64, 1, 512, [(0, n(6000), n(2000), None, 0)]),
        "prefix_caching": (
            16,
            6,
            128,
            [
                (i * 3, n(200) + rng.randrange(0, 40), n(120) + rng.randrange(0, 60), i % 3, max(1, n(160) // 16))
                for i in range(18)
            ],
        ),
        "churn_many": (
            16,
            12,
            64,
            [
                (rng.randrange(0, n(200)), rng.randrange(16, 17 + n(300)), rng.randrange(8, 9 + n(200)), None, 0)
                for _ in range(40)
            ],
        ),
    }
    return out


class Sim:
    def __init__(self, torch, device, kernels, geo: Geometry, backend: str, block_size: int, spec: int, seed: int):
        self.torch, self.device, self.k, self.geo, self.backend = torch, device, kernels, geo, backend
        self.bs, self.spec = block_size, spec
        self.rng = np.random.default_rng(seed)
        self.prng = random.Random(seed)
        self.rows = geo.conv_rows_base + spec
        nb = geo.num_blocks
        self.conv, self.temporal, self.conv_ref, self.temp_ref = [], [], [], []
        for _ in range(geo.layers):
            conv_bytes = self.rng.integers(0, 256, size=(nb, self.rows * geo.conv_dim * 2), dtype=np.uint8)
            temp_bytes = self.rng.integers(0, 256, size=(nb, geo.temporal_elems * 4), dtype=np.uint8)
            conv = torch.from_numpy(conv_bytes.copy()).to(device).view(torch.bfloat16).view(nb, self.rows, geo.conv_dim)
            temporal = torch.from_numpy(temp_bytes.copy()).to(device).view(torch.float32)
            self.conv.append(conv)
            self.temporal.append(temporal)
            self.conv_ref.append(conv_bytes)
            self.temp_ref.append(temp_bytes)
        self.states = []
        for c, t in zip(self.conv, self.temporal):
            self.states += [c, t]
        self.free = list(range(nb - 1, -1, -1))
        self.cache = {}  # prefix group -> block ids
        self.max_blocks = 0
        self.stats = dict(
            steps=0,
            pre_pairs=0,
            post_pairs=0,
            same_block_shifts=0,
            mismatched_steps=0,
            mismatched_blocks=0,
            decision_mismatches=0,
            first_mismatch_step=None,
        )

    # -- copies ---------------------------------------------------------------------------------
    def _pairs_bytes(self, layer, kind, src_blk, src_row_off, dst_blk, nbytes):
        pool = self.conv_ref[layer] if kind == 0 else self.temp_ref[layer]
        stride = pool.shape[1]
        return (layer * 2 + kind, src_blk * stride + src_row_off, dst_blk * stride, nbytes)

    def _apply_ref(self, pairs):
        for state, src, dst, n in pairs:
            pool = (self.conv_ref if state % 2 == 0 else self.temp_ref)[state // 2].reshape(-1)
            pool[dst : dst + n] = pool[src : src + n].copy()

    def _views(self, state, src, dst, n):
        t = self.states[state]
        flat = t.view(-1)
        es = t.element_size()
        return flat.narrow(0, src // es, n // es), flat.narrow(0, dst // es, n // es)

    def _run_pointer_pairs(self, pairs):
        torch = self.torch
        if not pairs:
            return
        src = torch.tensor(
            [self.states[s].data_ptr() + a for s, a, _, _ in pairs], dtype=torch.int64, device=self.device
        )
        dst = torch.tensor(
            [self.states[s].data_ptr() + b for s, _, b, _ in pairs], dtype=torch.int64, device=self.device
        )
        sizes = torch.tensor([n for *_, n in pairs], dtype=torch.int32, device=self.device)
        if self.backend == "unguarded":
            self.k["batch_memcpy_kernel"][(len(pairs),)](src, dst, sizes, BLOCK_SIZE=8192)
        else:
            self.k["batch_memmove"](src, dst, sizes)

    # -- one step --------------------------------------------------------------------------------
    def preprocess(self, batch, sched):
        row = self.geo.conv_dim * 2
        tbytes = self.geo.temporal_elems * 4
        pairs = []
        for r in batch:
            prev = r.state_idx if r.state_idx is not None else (r.computed - 1) // self.bs
            curr = cdiv(r.computed + sched[r.rid][0], self.bs) - 1
            r.state_idx = curr
            if prev != -1 and prev != curr:
                bias = r.num_accepted - 1
                for layer in range(self.geo.layers):
                    pairs.append(
                        self._pairs_bytes(
                            layer, 0, r.block_ids[prev], bias * row, r.block_ids[curr], (self.rows - bias) * row
                        )
                    )
                    pairs.append(self._pairs_bytes(layer, 1, r.block_ids[prev + bias], 0, r.block_ids[curr], tbytes))
                r.num_accepted = 1
        self.stats["pre_pairs"] += len(pairs)
        if self.backend in ("torch", "dropcopy"):
            for p in pairs:
                s, d = self._views(*p)
                d.copy_(s.clone())
        else:
            self._run_pointer_pairs(pairs)
        self._apply_ref(pairs)

    def forward(self, batch, sched):
        torch = self.torch
        conv_blocks = np.array([r.block_ids[r.state_idx] for r in batch], dtype=np.int64)
        idx = torch.from_numpy(conv_blocks).to(self.device)
        for layer in range(self.geo.layers):
            cref, tref = self.conv_ref[layer], self.temp_ref[layer]
            pat = self.rng.integers(0, 256, size=(len(batch), cref.shape[1]), dtype=np.uint8)
            cref[conv_blocks] ^= pat
            cu8 = self.conv[layer].view(-1).view(torch.uint8).view(cref.shape)
            cu8[idx] ^= torch.from_numpy(pat).to(self.device)
            tu8 = self.temporal[layer].view(torch.uint8).view(tref.shape)
            base_ref = tref[conv_blocks].copy()
            base_dev = tu8[idx].clone()
            for j in range(self.spec + 1):
                sel = [i for i, r in enumerate(batch) if sched[r.rid][1] >= j]
                if not sel:
                    continue
                blocks = np.array([batch[i].block_ids[batch[i].state_idx + j] for i in sel], dtype=np.int64)
                tpat = self.rng.integers(0, 256, size=(len(sel), tref.shape[1]), dtype=np.uint8)
                tref[blocks] = base_ref[sel] ^ tpat
                sel_t = torch.tensor(sel, device=self.device)
                tu8[torch.from_numpy(blocks).to(self.device)] = base_dev[sel_t] ^ torch.from_numpy(tpat).to(self.device)

    def decide(self, step_in):
        accepted, state_idx, scheduled, computed, draft = step_in
        running = computed + scheduled - draft
        aligned = (running + accepted - 1) // self.bs * self.bs
        if aligned < running:
            return None, accepted
        bias = aligned - running
        dest = aligned // self.bs - 1
        out = 1 if state_idx == dest else accepted
        if state_idx == dest and bias == 0:
            return None, out
        return (state_idx, dest, bias), out

    def postprocess(self, batch, sched, accepted):
        row = self.geo.conv_dim * 2
        tbytes = self.geo.temporal_elems * 4
        inputs = [(accepted[i], r.state_idx, sched[r.rid][0], r.computed, sched[r.rid][1]) for i, r in enumerate(batch)]
        decisions = [self.decide(x) for x in inputs]
        pairs = []
        for r, (copy, _) in zip(batch, decisions):
            if copy is None:
                continue
            src, dest, bias = copy
            if src == dest:
                self.stats["same_block_shifts"] += 1
            for layer in range(self.geo.layers):
                pairs.append(
                    self._pairs_bytes(
                        layer, 0, r.block_ids[src], bias * row, r.block_ids[dest], (self.rows - bias) * row
                    )
                )
                pairs.append(self._pairs_bytes(layer, 1, r.block_ids[src + bias], 0, r.block_ids[dest], tbytes))
        self.stats["post_pairs"] += len(pairs)
        if self.backend == "dropcopy" and pairs:
            pairs_run = pairs[:-1]  # checker self-test: one copy silently lost per step
        else:
            pairs_run = pairs
        expected_out = [out for _, out in decisions]
        if self.backend in ("torch", "dropcopy"):
            for p in pairs_run:
                s, d = self._views(*p)
                d.copy_(s.clone())
            got_out = expected_out
        else:
            got_out = self._run_fused(batch, inputs)
        self._apply_ref(pairs)
        self.stats["decision_mismatches"] += sum(int(a != b) for a, b in zip(got_out, expected_out))
        for r, out in zip(batch, expected_out):
            r.num_accepted = int(out)

    def _run_fused(self, batch, inputs):
        torch = self.torch
        dev = self.device
        kernel = self.k["postprocess_unguarded"] if self.backend == "unguarded" else self.k["postprocess_guarded"]
        width = max(len(r.block_ids) for r in batch)
        table = np.zeros((len(batch), width), dtype=np.int32)
        for i, r in enumerate(batch):
            table[i, : len(r.block_ids)] = r.block_ids
        table_dev = torch.from_numpy(table).to(dev)
        cols = [torch.tensor([x[c] for x in inputs], dtype=torch.int32, device=dev) for c in range(5)]
        out = cols[0].clone()
        st = self.states

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=dev)

        kernel[(len(batch), len(st))](
            cols[0],
            cols[1],
            cols[2],
            cols[3],
            cols[4],
            t([table_dev.data_ptr()], torch.int64),
            table_dev.stride(0),
            t([s.data_ptr() for s in st], torch.int64),
            t([s.stride(0) * s.element_size() for s in st], torch.int64),
            t([s.element_size() for s in st], torch.int32),
            t([s.stride(1) if i % 2 == 0 else s[0].numel() for i, s in enumerate(st)], torch.int64),
            t([s.size(1) if i % 2 == 0 else 0 for i, s in enumerate(st)], torch.int32),
            t([0] * len(st), torch.int32),
            out,
            len(batch),
            block_size=self.bs,
            COPY_BLOCK_SIZE=1024,
        )
        return out.cpu().tolist()

    def verify(self, step):
        bad = 0
        torch = self.torch
        common.synchronize(self.device)
        for layer in range(self.geo.layers):
            for dev_t, ref in ((self.conv[layer], self.conv_ref[layer]), (self.temporal[layer], self.temp_ref[layer])):
                got = dev_t.reshape(-1).view(torch.uint8).cpu().numpy().reshape(ref.shape)
                rows = np.flatnonzero((got != ref).any(axis=1))
                if rows.size:
                    bad += rows.size
                    dev_t.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(ref.reshape(-1)).to(self.device))
        if bad:
            self.stats["mismatched_steps"] += 1
            self.stats["mismatched_blocks"] += bad
            if self.stats["first_mismatch_step"] is None:
                self.stats["first_mismatch_step"] = step

    # -- scheduler -------------------------------------------------------------------------------
    def run(self, scenario, max_steps, deadline):
        _, max_running, chunk, arrivals = scenario
        pending = sorted(arrivals, key=lambda a: a[0])
        running: list[Request] = []
        rid = 0
        step = 0
        while (pending or running) and step < max_steps and time.time() < deadline:
            while pending and pending[0][0] <= step and len(running) < max_running:
                _, prompt, output, group, pblocks = pending[0]
                need = cdiv(prompt + output + self.spec + 1, self.bs) + self.spec + 2
                shared = self.cache.get(group, []) if group is not None else []
                if len(self.free) < need - len(shared):
                    break
                pending.pop(0)
                r = Request(rid, prompt, output, group, pblocks)
                rid += 1
                if shared and len(shared) * self.bs < prompt:
                    r.block_ids = list(shared) + [self.free.pop() for _ in range(need - len(shared))]
                    r.shared = len(shared)
                    r.computed = len(shared) * self.bs  # prefix-cache hit
                else:
                    r.block_ids = [self.free.pop() for _ in range(need)]
                running.append(r)
            if not running:
                step += 1
                continue
            batch = list(running)
            sched = {}
            for r in batch:
                if r.computed < r.prompt:
                    sched[r.rid] = (min(chunk, r.prompt - r.computed), 0)
                else:
                    draft = self.spec
                    sched[r.rid] = (1 + draft, draft)
            self.preprocess(batch, sched)
            self.forward(batch, sched)
            accepted = [1 if sched[r.rid][1] == 0 else self.prng.randint(1, sched[r.rid][1] + 1) for r in batch]
            self.postprocess(batch, sched, accepted)
            for r, a in zip(batch, accepted):
                scheduled, draft = sched[r.rid]
                r.computed = r.computed + scheduled - draft + a - 1
                if r.computed >= r.prompt:
                    r.generated += a if draft else 1
            self.verify(step)
            self.stats["steps"] += 1
            for r in [r for r in running if r.generated >= r.output]:
                running.remove(r)
                own = r.block_ids[r.shared :]
                if r.prefix_group is not None and r.prefix_group not in self.cache and r.prefix_blocks:
                    keep = min(r.prefix_blocks, r.prompt // self.bs)
                    self.cache[r.prefix_group] = own[:keep]
                    own = own[keep:]
                self.free.extend(reversed(own))
            step += 1
        return self.stats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", help="kernel trees (default: repo overlay + build/fork)")
    parser.add_argument(
        "--base-tree",
        default=str(common.ROOT / "build" / "base"),
        help="unpatched tree: its fused postprocess kernel is the control",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--backends", default="unguarded,memmove,torch")
    parser.add_argument("--geometries", default="gdn_like,adversarial")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--max-steps", type=int, default=100000)
    parser.add_argument("--seconds", type=float, default=600, help="time budget for the whole run")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    kernels = common.setup_kernels(args.tree, base_tree=args.base_tree)
    import torch

    device = common.select_device(args.device)
    smoke = args.smoke or device == "cpu"
    geos = {
        "gdn_like": Geometry("gdn_like", 3, 1024, 2048),
        "adversarial": Geometry("adversarial", 2048, 8, 2048),
    }
    if smoke:
        geos = {
            "gdn_like": Geometry("gdn_like", 3, 32, 64, num_blocks=256),
            "adversarial": Geometry("adversarial", 64, 8, 64, num_blocks=256),
        }
    scale = 0.05 if smoke else args.scale
    max_steps = 12 if smoke else args.max_steps
    meta = {"device": common.device_name(device), "versions": common.versions(), "date": common.now()}
    results = []
    names = [g for g in args.geometries.split(",") if g]
    backends = [b for b in args.backends.split(",") if b]
    scen = scenarios(scale, 3)
    jobs = [(g, b, s) for g in names for s in scen for b in backends]
    start = time.time()
    for i, (g, b, s) in enumerate(jobs):
        spec = {
            "two_long_then_reuse": 3,
            "three_concurrent": 2,
            "long_decode_high_context": 3,
            "prefix_caching": 1,
            "churn_many": 3,
        }[s]
        bs, max_running, chunk, arrivals = scen[s]
        sim = Sim(torch, device, kernels, geos[g], b, bs, spec, seed=zlib.crc32(f"{g}/{s}".encode()) % 1000)
        # an equal share of the remaining budget for each remaining job
        budget = (args.seconds - (time.time() - start)) / (len(jobs) - i)
        t0 = time.time()
        stats = sim.run(scen[s], max_steps, time.time() + budget)
        rec = {
            "geometry": g,
            "backend": b,
            "scenario": s,
            "spec_tokens": spec,
            "block_size": bs,
            "requests": len(arrivals),
            "seconds": round(time.time() - t0, 1),
            **stats,
            **meta,
        }
        results.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "versions"}), flush=True)
        del sim
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    bad = sum(
        r["mismatched_steps"] + r["decision_mismatches"]
        for r in results
        if r["backend"] not in ("unguarded", "dropcopy")
    )
    lost = [r for r in results if r["backend"] == "dropcopy" and r["post_pairs"] and not r["mismatched_steps"]]
    if lost:
        print(f"align_trace: checker self-test failed: dropped copies went unnoticed in {len(lost)} runs")
        bad += len(lost)
    print(f"align_trace: non-control mismatches {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
