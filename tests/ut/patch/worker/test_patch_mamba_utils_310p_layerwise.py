# SPDX-License-Identifier: Apache-2.0
"""310P align-mode Mamba state copies with a layerwise KV connector (patch_mamba_utils).

310P has no Triton batch memcpy: patch_mamba_utils binds its torch collector and
tensor-pair copy there. With a layerwise KV-pool connector the model runner does not
run the bulk copy; the connector stages the step (prepare_mamba_copy_by_layer), copies
each layer's states right after that layer's KV load (do_mamba_copy_block_for_layer)
and checks at the end that every layer ran (finish_mamba_copy_by_layer).

patch_mamba_utils is reloaded with the 310P hardware profile, and vLLM's entry points
are called as the model runner and the connector call them, over Mamba state pools
carved out of one random byte buffer. Every byte of that buffer is compared with a
plain-Python model of the step: per layer, its load, then its state moves as numpy
memmoves in pair order.
"""

import contextlib
import importlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker import mamba_utils

import vllm_ascend.device.hardware_profile as hardware_profile
import vllm_ascend.patch.worker.patch_mamba_utils as pm
from vllm_ascend.device.hardware import AscendDeviceType

BLOCK_SIZE = 4
NUM_BLOCKS = 12
WIDTH, DIM = 4, 8  # conv state (SD layout): WIDTH token rows of DIM bf16 values
TEMPORAL = (2, 3, 4)  # temporal state, float32
GUARD = 64  # bytes before, between and after the pools: a stray write shows there
# Layers in model order: the hybrid groups interleave (group 0: layers 0 and 2).
LAYERS = {f"model.layers.{i}.linear_attn": i % 2 for i in range(4)}

# One scheduler step: (req_id, block ids per group, num_computed_tokens,
# num_scheduled_tokens, accepted tokens of the last step, state index of the
# last step or None, the move preprocess_mamba must collect or None).
# A move is (src block index, dest block index, accepted-token bias).
STEP = [
    ("decode", ([1, 2, 3], [7, 8, 9]), 8, 1, 1, 1, (1, 2, 0)),
    ("spec", ([4, 5, 6, 10], [11, 0, 2, 3]), 6, 3, 3, 1, (1, 2, 2)),
    ("hit", ([0, 9, 11], [1, 4, 5]), 5, 7, 1, None, (1, 2, 0)),
    ("same", ([7, 8, 10], [6, 10, 9]), 9, 1, 1, 2, None),
    ("load-only", ([3], [3]), 4, 0, 1, 0, None),
]


@contextlib.contextmanager
def bound_310p(monkeypatch):
    """patch_mamba_utils bound as on a 310P device; every binding restored afterwards."""
    saved_vllm, saved_pm = dict(vars(mamba_utils)), dict(vars(pm))
    saved_create = vars(mamba_utils.MambaCopyBuffers)["create"]
    profile = hardware_profile.get_hardware_profile(AscendDeviceType._310P)
    with monkeypatch.context() as mp:
        mp.setattr(hardware_profile, "get_current_hardware_profile", lambda: profile)
        try:
            importlib.reload(pm)
            yield
        finally:
            vars(mamba_utils).clear()
            vars(mamba_utils).update(saved_vllm)
            mamba_utils.MambaCopyBuffers.create = saved_create
            vars(pm).clear()
            vars(pm).update(saved_pm)


class Pools:
    """A conv and a temporal state pool per layer, each a view of one random byte buffer."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.conv_row = DIM * 2
        self.conv_bytes = WIDTH * self.conv_row
        self.temporal_bytes = int(np.prod(TEMPORAL)) * 4
        size = GUARD + len(LAYERS) * (NUM_BLOCKS * (self.conv_bytes + self.temporal_bytes) + 2 * GUARD)
        self.raw = torch.from_numpy(self.rng.integers(0, 256, size, dtype=np.uint8))
        self.conv_at, self.temporal_at, self.forward_context = {}, {}, {}
        at = GUARD
        for name in LAYERS:
            self.conv_at[name] = at
            conv = self.raw[at : at + NUM_BLOCKS * self.conv_bytes].view(torch.bfloat16)
            at += NUM_BLOCKS * self.conv_bytes + GUARD
            self.temporal_at[name] = at
            temporal = self.raw[at : at + NUM_BLOCKS * self.temporal_bytes].view(torch.float32)
            at += NUM_BLOCKS * self.temporal_bytes + GUARD
            states = [conv.view(NUM_BLOCKS, WIDTH, DIM), temporal.view(NUM_BLOCKS, *TEMPORAL)]
            self.forward_context[name] = SimpleNamespace(kv_cache=states)
        spec = MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=((WIDTH, DIM), TEMPORAL),
            dtypes=(torch.bfloat16, torch.float32),
            mamba_cache_mode="align",
            num_speculative_blocks=1,
        )
        groups = [[name for name, g in LAYERS.items() if g == group] for group in (0, 1)]
        self.kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec) for names in groups],
        )
        self.copy_funcs = {spec.mamba_type: (get_conv_copy_spec, get_temporal_copy_spec)}

    def moves(self, name):
        """(src, dst, nbytes) byte offsets of the layer's state moves, in collection order."""
        group = LAYERS[name]
        out = []
        for _, block_ids, *_, move in STEP:
            if move is None:
                continue
            src, dest, bias = move
            ids = block_ids[group]
            # conv: the rows from the bias on, to the start of the dest block
            conv, size, shift = self.conv_at[name], self.conv_bytes, bias * self.conv_row
            out.append((conv + ids[src] * size + shift, conv + ids[dest] * size, size - shift))
            # temporal: the whole state of the block the accepted tokens end in
            temporal, size = self.temporal_at[name], self.temporal_bytes
            out.append((temporal + ids[src + bias] * size, temporal + ids[dest] * size, size))
        return out

    def loads(self, name):
        """What the layer's KV load writes: fresh bytes over every source of its moves."""
        return [(src, self.rng.integers(0, 256, n, dtype=np.uint8)) for src, _, n in self.moves(name)]


def copy_buffers(pools):
    """The model runner's MambaCopyBuffers, made before patch_mamba_utils is reloaded (its create wraps itself)."""
    make_buffer = lambda n, dtype: CpuGpuBuffer(n, dtype=dtype, device=torch.device("cpu"), pin_memory=False)  # noqa: E731
    return mamba_utils.MambaCopyBuffers.create(len(STEP), pools.kv_cache_config, pools.copy_funcs, make_buffer)


def preprocess(pools, copy_bufs):
    """The model runner's preprocess_mamba for STEP, through the bound vLLM entry point."""
    scheduled = {req_id: n for req_id, _, _, n, *_ in STEP}
    mamba_utils.preprocess_mamba(
        SimpleNamespace(
            finished_req_ids=set(),
            preempted_req_ids=set(),
            scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
            num_scheduled_tokens=scheduled,
        ),
        pools.kv_cache_config,
        None,
        {req_id: idx for req_id, *_, idx, _ in STEP if idx is not None},
        SimpleNamespace(
            req_ids=list(scheduled),
            num_accepted_tokens_cpu=np.array([accepted for *_, accepted, _, _ in STEP], dtype=np.int32),
        ),
        {req_id: SimpleNamespace(block_ids=ids, num_computed_tokens=c) for req_id, ids, c, *_ in STEP},
        pools.forward_context,
        pools.copy_funcs,
        copy_bufs,
    )


def expected(before, steps):
    """numpy model: each (loads, moves) in turn, a load's writes, then memmoves in pair order."""
    out = before.copy()
    for loads, moves in steps:
        for at, data in loads:
            out[at : at + len(data)] = data
        for src, dst, n in moves:
            out[dst : dst + n] = out[src : src + n].copy()
    return out


def assert_bytes(pools, want):
    got = pools.raw.numpy()
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} of {got.size} bytes differ from the model (first at byte {bad[0]})"


def test_layerwise_copies_run_after_each_layer_load(monkeypatch):
    """310P, layerwise KV pool: every layer's moves land, each reading what that layer's load wrote."""
    pools = Pools()
    copy_bufs = copy_buffers(pools)
    with bound_310p(monkeypatch):
        preprocess(pools, copy_bufs)
        before = pools.raw.numpy().copy()
        mamba_utils.prepare_mamba_copy_by_layer(copy_bufs)  # the connector takes the step's copies
        steps = []
        for name in LAYERS:  # wait_for_layer_load, layer by layer
            loads = pools.loads(name)
            for at, data in loads:
                pools.raw[at : at + len(data)] = torch.from_numpy(data)
            mamba_utils.do_mamba_copy_block_for_layer(copy_bufs, name)
            steps.append((loads, pools.moves(name)))
        mamba_utils.finish_mamba_copy_by_layer(copy_bufs)
    assert_bytes(pools, expected(before, steps))


def test_whole_batch_copy_runs_each_move_once(monkeypatch):
    """310P without a layerwise connector: one bulk copy of the step, every move exactly once."""
    pools = Pools()
    copy_bufs = copy_buffers(pools)
    with bound_310p(monkeypatch):
        preprocess(pools, copy_bufs)
        before = pools.raw.numpy().copy()
        mamba_utils.do_mamba_copy_block(copy_bufs)
    assert_bytes(pools, expected(before, [((), [m for name in LAYERS for m in pools.moves(name)])]))


@pytest.mark.parametrize("skipped", list(LAYERS))
def test_finish_names_a_layer_whose_copy_did_not_run(monkeypatch, skipped):
    """A layer the connector never reported loaded is an error, not a silently stale state."""
    pools = Pools()
    copy_bufs = copy_buffers(pools)
    with bound_310p(monkeypatch):
        preprocess(pools, copy_bufs)
        mamba_utils.prepare_mamba_copy_by_layer(copy_bufs)
        for name in LAYERS:
            if name != skipped:
                mamba_utils.do_mamba_copy_block_for_layer(copy_bufs, name)
        with pytest.raises(RuntimeError, match=skipped):
            mamba_utils.finish_mamba_copy_by_layer(copy_bufs)
