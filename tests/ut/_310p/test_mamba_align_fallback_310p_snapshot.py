# SPDX-License-Identifier: Apache-2.0
#
# Copyright (c) 2026 Huawei Technologies Co., Ltd. All Rights Reserved.
# This file is a part of the vllm-ascend project.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
"""Behavioural regression test: the 310P align fallback follows this step's accepted-token snapshot.

``_postprocess_mamba_align_gpu_cpu_fallback`` must take the accepted-token counts
from ``num_accepted_tokens_cpu_tensor`` (staged from the GPU counts of this step),
never from ``input_batch.num_accepted_tokens_cpu``, whose rows async scheduling may
already have condensed or reused. Each random step below gives the live field stale,
condensed or reused rows and checks the decisions, the state copies and the
``src == dest`` reset to 1 against a plain-Python model of the fused kernel's rule.
"""

import random
from types import SimpleNamespace

import numpy as np
import torch
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.worker import mamba_utils

from vllm_ascend.patch.worker import patch_mamba_utils
from vllm_ascend.patch.worker.patch_mamba_utils import _postprocess_mamba_align_gpu_cpu_fallback

COPY_FUNCS = {MambaAttentionBackendEnum.MAMBA2: (get_conv_copy_spec, get_temporal_copy_spec)}
NUM_STEPS = 200
LAYERS = ("model.layers.0.linear_attn", "model.layers.1.linear_attn")
# Per block: conv state (WIDTH, DIM) in the token-major layout (the dim-first one is out of scope here),
# temporal state TEMPORAL.
WIDTH, DIM, TEMPORAL = 4, 4, (2, 3)
MAX_BLOCKS = 32  # covers the running-state block + accept-token bias for block_size 2


def reference_decisions(reqs, accepted, block_size):
    """The fused postprocess kernel's rule: per request, (copy or None, accepted-token count after the step).

    It restates the fallback's arithmetic on purpose: what the test checks is which counts feed it
    (this step's snapshot, not the live rows) and the bytes the decided copies move.
    """
    out = []
    for (computed, scheduled, draft, state_idx), num_accepted in zip(reqs, accepted):
        running = computed + scheduled - draft
        aligned = (running + num_accepted - 1) // block_size * block_size
        if aligned < running:
            out.append((None, num_accepted))
            continue
        dest_idx, bias = aligned // block_size - 1, aligned - running
        if state_idx == dest_idx:
            out.append((None if bias == 0 else (state_idx, dest_idx, bias), 1))
        else:
            out.append(((state_idx, dest_idx, bias), num_accepted))
    return out


class Pools:
    """Conv (blocks, WIDTH, DIM) and temporal (blocks, *TEMPORAL) pools per layer in one poisoned byte buffer."""

    def __init__(self, num_blocks, rng):
        self.conv_bytes = WIDTH * DIM * 4
        self.temporal_bytes = int(np.prod(TEMPORAL)) * 4
        layer_bytes = num_blocks * (self.conv_bytes + self.temporal_bytes)
        self.raw = torch.frombuffer(bytearray(rng.randbytes(len(LAYERS) * layer_bytes + 64)), dtype=torch.uint8)
        self.offsets, self.forward_context = {}, {}
        start = 32
        for name in LAYERS:
            mid = start + num_blocks * self.conv_bytes
            end = mid + num_blocks * self.temporal_bytes
            conv = self.raw[start:mid].view(torch.float32).view(num_blocks, WIDTH, DIM)
            temporal = self.raw[mid:end].view(torch.float32).view(num_blocks, *TEMPORAL)
            self.offsets[name] = (start, mid)
            self.forward_context[name] = SimpleNamespace(kv_cache=[conv, temporal])
            start = end

    def expected(self, copies):
        """numpy memmove of every (block_ids, src_idx, dest_idx, bias) move, in request order."""
        out = self.raw.numpy().copy()
        row = DIM * 4
        for block_ids, src_idx, dest_idx, bias in copies:
            dst_blk = block_ids[dest_idx]
            for name in LAYERS:
                conv, temporal = self.offsets[name]
                ranges = (
                    (conv + block_ids[src_idx] * self.conv_bytes + bias * row, conv + dst_blk * self.conv_bytes),
                    (
                        temporal + block_ids[src_idx + bias] * self.temporal_bytes,
                        temporal + dst_blk * self.temporal_bytes,
                    ),
                )
                for (s, d), n in zip(ranges, ((WIDTH - bias) * row, self.temporal_bytes)):
                    out[d : d + n] = out[s : s + n].copy()
        return out


def stale_rows(true_accepted, rng, max_accepted):
    """The live field as async scheduling can leave it: condensed, stale or reused rows."""
    kind = rng.choice(["condensed", "stale", "reused"])
    live = list(true_accepted)
    if kind == "condensed":  # a finished request's row was compacted away: rows moved up by one
        live = live[1:] + [rng.randint(1, max_accepted)]
    elif kind == "stale":  # counts that are not this step's
        live = [rng.randint(1, max_accepted) for _ in live]
    else:  # rows handed to new requests start at 1
        live = [1 if rng.random() < 0.5 else a for a in live]
    return np.array(live, dtype=np.int32)


def random_step(rng):
    block_size = rng.choice([2, 4, 8])
    num_spec = rng.randint(1, 3)
    num_reqs = rng.randint(1, 6)
    reqs, accepted = [], []
    for _ in range(num_reqs):
        computed = rng.randint(0, 40)
        draft = rng.randint(0, num_spec)
        scheduled = 1 + draft
        state_idx = -(-(computed + scheduled) // block_size) - 1  # preprocess_mamba's running-state block
        reqs.append((computed, scheduled, draft, state_idx))
        accepted.append(rng.randint(1, 1 + draft))
    return block_size, num_spec, reqs, accepted


def run_fallback(block_size, reqs, snapshot, live, block_table, pools):
    num_reqs = len(reqs)
    columns = list(zip(*reqs))

    def buf(values):
        return SimpleNamespace(np=np.array(values, dtype=np.int32))

    ctx = SimpleNamespace(
        mamba_state_idx_buf=buf(columns[3]),
        num_scheduled_tokens_buf=buf(columns[1]),
        num_computed_tokens_buf=buf(columns[0]),
        num_draft_tokens_buf=buf(columns[2]),
        block_size=block_size,
        mamba_group_ids=[0],
    )
    input_batch = SimpleNamespace(
        block_table=[SimpleNamespace(get_numpy_array=lambda: block_table)],
        num_accepted_tokens_cpu=live,
    )
    spec = MambaSpec(
        block_size=block_size,
        shapes=((WIDTH, DIM), TEMPORAL),
        dtypes=(torch.float32, torch.float32),
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
    )
    out = torch.full((num_reqs + 2,), -7, dtype=torch.int32)  # garbage before the fallback stages it
    _postprocess_mamba_align_gpu_cpu_fallback(
        bufs=SimpleNamespace(postprocess_align=ctx),
        num_reqs=num_reqs,
        num_accepted_tokens_gpu=torch.tensor(snapshot + [0, 0], dtype=torch.int32),
        num_accepted_tokens_cpu_tensor=out,
        input_batch=input_batch,
        kv_cache_config=KVCacheConfig(
            num_blocks=len(block_table.flat),
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        ),
        forward_context=pools.forward_context,
        mamba_state_copy_funcs=COPY_FUNCS,
    )
    assert out[num_reqs:].tolist() == [-7, -7], "rows past num_reqs must stay untouched"
    return out[:num_reqs].tolist()


def _no_triton(*args, **kwargs):
    raise AssertionError("the 310P fallback launched the fused Triton kernel")


def test_fallback_follows_the_accepted_token_snapshot_not_the_live_rows(monkeypatch):
    # 310P's path has no Triton: a launch of the fused postprocess kernel fails the test.
    monkeypatch.setattr(patch_mamba_utils, "postprocess_mamba_fused_kernel", _no_triton)
    monkeypatch.setattr(mamba_utils, "postprocess_mamba_fused_kernel", _no_triton, raising=False)
    # The token-major conv layout: vLLM's conv copy spec refuses a shifted dim-first state.
    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
    rng = random.Random(20261130)
    divergent = shifted_in_place = 0
    for step in range(NUM_STEPS):
        block_size, num_spec, reqs, snapshot = random_step(rng)
        live = stale_rows(snapshot, rng, 1 + num_spec)
        expected = reference_decisions(reqs, snapshot, block_size)
        # the only copy that overlaps itself: a conv shift inside the request's own block
        shifted_in_place += sum(move is not None and move[0] == move[1] for move, _ in expected)
        divergent += expected != reference_decisions(reqs, live.tolist(), block_size)

        num_reqs = len(reqs)
        physical = rng.sample(range(num_reqs * MAX_BLOCKS), num_reqs * MAX_BLOCKS)
        block_table = np.array(physical, dtype=np.int32).reshape(num_reqs, MAX_BLOCKS)
        pools = Pools(num_reqs * MAX_BLOCKS, rng)
        copies = [(block_table[i].tolist(), *move) for i, (move, _) in enumerate(expected) if move is not None]
        oracle = pools.expected(copies)
        live_before = live.copy()

        counts = run_fallback(block_size, reqs, snapshot, live, block_table, pools)

        context = f"step {step}: reqs={reqs} snapshot={snapshot} live={live_before.tolist()} bs={block_size}"
        assert counts == [n for _, n in expected], context
        np.testing.assert_array_equal(pools.raw.numpy(), oracle, err_msg=context)
        # The fallback reads this step's counts from the snapshot only; the live rows are the scheduler's.
        np.testing.assert_array_equal(live, live_before, err_msg="the fallback must not write the live rows")
    # The scenario exercises the bug: on many steps the live rows would lead to other decisions.
    assert divergent >= NUM_STEPS // 4, divergent
    assert shifted_in_place > 0, "no step drew a same-block shift"
