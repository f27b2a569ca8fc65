"""Copy audit: what vLLM's real scheduler makes a vllm-ascend release's real align-mode code copy.

    python benchmarks/copy_audit.py --tree build/base-0.30.0rc2 --json benchmarks/results/copy_audit_0.30.0rc2.json
    python benchmarks/copy_audit.py --tree build/base-0.30.0rc2 --smoke     # a few hundred steps

Run it with the Python of the base's CPU test environment (`fork test --env-only --base VERSION` builds
it: the vLLM release the base pairs with, as pure Python). It stubs torch_npu with the tree's own
`tests/ut/conftest.py`, as upstream's CPU CI does, and imports the tree's `vllm_ascend` from `--tree`.

No model runs. Each step:

1. vLLM's v1 `Scheduler` (its KV-cache manager, block pool and MambaManager, prefix caching on,
   `mamba_cache_mode="align"`, 3 speculative tokens) schedules the requests of a scenario;
2. the worker's bookkeeping takes the `SchedulerOutput` as the model runner's `_update_states` does
   (block ids appended, replaced on resumption; rows removed and added);
3. the release's own `preprocess_mamba` (vllm-ascend's replacement, bound in `vllm.v1.worker.mamba_utils`)
   runs over small state tensors laid out as the release's model runner lays them out, with the
   collector of each hardware binding: the pointer tables A2/A3 stage for `batch_memcpy_kernel`, and
   the tensor pairs 310P copies;
4. the accepted-token counts are drawn at random (1 to 1 + drafts), and the fused postprocess's
   decision runs as the release's own 310P fallback computes it (the fused kernel mirrors it);
5. the scheduler takes the sampled tokens back (`update_from_output`) and 3 draft tokens per
   decoding request (`update_draft_token_ids`), as the engine core does.

Every copy launch is recorded as (src address, dst address, bytes) and checked against the state
tensors and the block pool: pairs that overlap themselves (identical ranges, left or right shifts),
pairs that touch another pair of the same launch, ranges outside every state tensor or across a
block, and blocks that are free or handed to another request in the step of the copy.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.util
import itertools
import json
import os
import random
import sys
import tempfile
import time
import types
from pathlib import Path

BLOCK_SIZE = 16
NUM_SPEC = 3  # speculative tokens (configure() changes it for a run)
LAYERS_PER_GROUP = 2
NUM_MAMBA_GROUPS = 3
CONV_WIDTH, CONV_DIM = 4, 8  # conv rows per block: CONV_WIDTH - 1 + NUM_SPEC
TEMPORAL_SHAPE = (2, 4, 4)
VOCAB = 1000


def configure(num_spec: int) -> None:
    """The run's number of speculative tokens: the conv state holds CONV_WIDTH - 1 + num_spec rows."""
    global NUM_SPEC
    NUM_SPEC = num_spec


# ---------------------------------------------------------------------------------------------
# Scenarios, from the seed's reproductions
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arrival:
    step: int
    prompt_len: int
    max_tokens: int
    prefix: int = -1  # requests with the same prefix id share their first `prefix_len` tokens
    prefix_len: int = 0


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    arrivals: tuple[Arrival, ...]
    num_blocks: int
    max_num_seqs: int = 16
    max_batched_tokens: int = 512


def scenarios(scale: int, rng: random.Random) -> list[Scenario]:
    """`scale` 1 is the small run `make test` takes; larger scales lengthen every request."""
    long = 600 * scale
    churn = tuple(
        Arrival(step=rng.randrange(0, 60 * scale), prompt_len=rng.randrange(5, 90), max_tokens=rng.randrange(4, 60))
        for _ in range(40 * scale)
    )
    return [
        Scenario(
            "two_long_then_reuse",
            (
                Arrival(0, 300, long),
                Arrival(0, 280, long),
                Arrival(long // 2, 300, long),
                Arrival(long // 2, 290, long),
            ),
            num_blocks=400 * scale,
        ),
        Scenario(
            "three_concurrent",
            (Arrival(0, 200, long // 2), Arrival(1, 150, long // 2), Arrival(2, 250, long // 2)),
            num_blocks=300 * scale,
        ),
        Scenario("long_decode_high_context", (Arrival(0, 1500, long),), num_blocks=300 * scale, max_batched_tokens=256),
        Scenario(
            "shared_prefix",
            # The first prompt ends on a block boundary, where align mode caches the state the others hit.
            tuple(Arrival(i * 3, 160 + 23 * i, 80, prefix=0, prefix_len=160) for i in range(6)),
            num_blocks=400 * scale,
        ),
        # Few blocks: the scheduler preempts and resumes requests.
        Scenario("churn_preemption", churn, num_blocks=90, max_num_seqs=12, max_batched_tokens=256),
    ]


# ---------------------------------------------------------------------------------------------
# Set-up: the tree's torch_npu stub, a vLLM config without a model, a hybrid KV-cache config
# ---------------------------------------------------------------------------------------------


def import_tree(tree: Path):
    """Make `tree`'s vllm_ascend importable the way upstream's CPU tests import it."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(tree))
    if not (tree / "vllm_ascend" / "_build_info.py").exists():
        # What upstream's CPU CI gets from its editable install with SOC_VERSION=ascend910b1.
        info = types.ModuleType("vllm_ascend._build_info")
        info.__soc_version__, info.__device_type__ = "ASCEND910B1", "A2"
        sys.modules[info.__name__] = info
    spec = importlib.util.spec_from_file_location("_tree_ut_conftest", tree / "tests" / "ut" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # stubs torch_npu when there is no NPU


def vllm_config(scenario: Scenario):
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig

    model_dir = tempfile.mkdtemp(prefix="copy-audit-model-")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 16384, "torch_dtype": "float32",
    }  # fmt: skip
    Path(model_dir, "config.json").write_text(json.dumps(config))
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=16384, dtype="float32")
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True, mamba_cache_mode="align"),
        scheduler_config=SchedulerConfig(
            max_num_seqs=scenario.max_num_seqs, max_num_batched_tokens=scenario.max_batched_tokens,
            max_model_len=16384, is_encoder_decoder=False,
        ),
        speculative_config=SpeculativeConfig(
            method="ngram", num_speculative_tokens=NUM_SPEC, prompt_lookup_max=3, prompt_lookup_min=2
        ),
        device_config=DeviceConfig(device="cpu"),
    )  # fmt: skip


def layer_name(group: int, index: int) -> str:
    return f"model.layers.{group * LAYERS_PER_GROUP + index}.{'self_attn' if group == 0 else 'linear_attn'}"


def kv_cache_config(num_blocks: int):
    """Group 0 attention, groups 1..NUM_MAMBA_GROUPS Mamba (GDN-like), LAYERS_PER_GROUP layers each."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    mamba = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((CONV_WIDTH - 1 + NUM_SPEC, CONV_DIM), TEMPORAL_SHAPE),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
        mamba_cache_mode="align",
        num_speculative_blocks=NUM_SPEC,
    )
    attention = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=4, dtype=torch.float32)
    groups = [KVCacheGroupSpec([layer_name(0, j) for j in range(LAYERS_PER_GROUP)], attention)]
    groups += [
        KVCacheGroupSpec([layer_name(g, j) for j in range(LAYERS_PER_GROUP)], mamba)
        for g in range(1, NUM_MAMBA_GROUPS + 1)
    ]
    # The scheduler reads no kv_cache_tensors; the worker's layout is built by state_tensors().
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def conv_bytes() -> int:
    return (CONV_WIDTH - 1 + NUM_SPEC) * CONV_DIM * 2


def page_bytes() -> int:
    temporal = 4
    for d in TEMPORAL_SHAPE:
        temporal *= d
    return conv_bytes() + temporal


@dataclasses.dataclass(frozen=True)
class StateTensor:
    layer: str
    group: int
    kind: str  # "conv" | "temporal"
    base: int
    block_stride: int  # bytes
    block_bytes: int
    num_blocks: int


def state_tensors(num_blocks: int, layout: str):
    """Per Mamba layer [conv, temporal] views into each block's page.

    `backing`: one allocation, region j shared by layer j of every group (0.30.0rc2's hybrid layout);
    `shared`: one tensor per region j, shared by layer j of every group (0.23.0.post1's model runner);
    `separate`: one allocation per layer (0.23.0.post1's 310P fallback calls `state.view(-1)`, which a
    page-interleaved state refuses).
    """
    import torch

    page = page_bytes()
    regions = [torch.zeros(num_blocks * page, dtype=torch.int8) for _ in range(LAYERS_PER_GROUP)]
    if layout == "separate":  # one allocation per layer: no region shared between groups
        regions = []
    if layout == "backing":
        backing = torch.zeros(LAYERS_PER_GROUP * num_blocks * page, dtype=torch.int8)
        regions = [backing[j * num_blocks * page : (j + 1) * num_blocks * page] for j in range(LAYERS_PER_GROUP)]
    temporal_numel = page_bytes() // 4 - conv_bytes() // 4
    t_strides = [temporal_numel // TEMPORAL_SHAPE[0], TEMPORAL_SHAPE[2], 1]
    context, index = {}, []
    for g in range(1, NUM_MAMBA_GROUPS + 1):
        for j in range(LAYERS_PER_GROUP):
            if layout == "separate":
                conv = torch.zeros(num_blocks, CONV_WIDTH - 1 + NUM_SPEC, CONV_DIM, dtype=torch.bfloat16)
                temporal = torch.zeros(num_blocks, *TEMPORAL_SHAPE, dtype=torch.float32)
            else:
                start = regions[j].storage_offset()
                conv = (
                    regions[j]
                    .view(torch.bfloat16)
                    .as_strided((num_blocks, CONV_WIDTH - 1 + NUM_SPEC, CONV_DIM), (page // 2, CONV_DIM, 1), start // 2)
                )
                temporal = (
                    regions[j]
                    .view(torch.float32)
                    .as_strided((num_blocks, *TEMPORAL_SHAPE), (page // 4, *t_strides), (start + conv_bytes()) // 4)
                )
            name = layer_name(g, j)
            context[name] = _Layer([conv, temporal])
            for kind, state in (("conv", conv), ("temporal", temporal)):
                block_bytes = state[0].numel() * state.element_size()
                stride = state.stride(0) * state.element_size()
                index.append(StateTensor(name, g, kind, state.data_ptr(), stride, block_bytes, num_blocks))
    return context, index


class _Layer:
    def __init__(self, kv_cache):
        self.kv_cache = kv_cache


# ---------------------------------------------------------------------------------------------
# The worker's bookkeeping of a SchedulerOutput (the model runner's _update_states, synchronous)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RequestState:
    block_ids: list[list[int]]
    num_computed_tokens: int
    num_prompt_tokens: int


class BlockTableView:
    def __init__(self, batch: Batch, group: int):
        self.batch, self.group = batch, group

    def get_numpy_array(self):
        import numpy as np

        width = max((len(self.batch.requests[r].block_ids[self.group]) for r in self.batch.req_ids), default=1)
        rows = np.zeros((max(len(self.batch.req_ids), 1), width), dtype=np.int32)
        for i, r in enumerate(self.batch.req_ids):
            ids = self.batch.requests[r].block_ids[self.group]
            rows[i, : len(ids)] = ids
        return rows


class Batch:
    """The persistent batch: request rows in order, and their accepted-token counts."""

    def __init__(self, max_reqs: int):
        import torch

        self.requests: dict[str, RequestState] = {}
        self.req_ids: list[str] = []
        self.num_accepted_tokens_cpu_tensor = torch.ones(max_reqs, dtype=torch.int64)
        self.num_accepted_tokens_cpu = self.num_accepted_tokens_cpu_tensor.numpy()
        self.block_table = [BlockTableView(self, g) for g in range(NUM_MAMBA_GROUPS + 1)]

    def _remove(self, req_id: str) -> None:
        if req_id in self.req_ids:
            i = self.req_ids.index(req_id)
            last = len(self.req_ids) - 1
            # condense: the last row moves into the hole, with its count
            self.num_accepted_tokens_cpu[i] = self.num_accepted_tokens_cpu[last]
            self.req_ids[i] = self.req_ids[last]
            self.req_ids.pop()

    def _add(self, req_id: str) -> None:
        self.req_ids.append(req_id)
        self.num_accepted_tokens_cpu[len(self.req_ids) - 1] = 1

    def update(self, so) -> None:
        for req_id in itertools.chain(so.finished_req_ids, so.preempted_req_ids or ()):
            self._remove(req_id)
            if req_id in so.finished_req_ids:
                self.requests.pop(req_id, None)
        scheduled = set(so.num_scheduled_tokens)
        for req_id in list(self.req_ids):
            if req_id not in scheduled:
                self._remove(req_id)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = RequestState(
                [list(ids) for ids in new.block_ids], new.num_computed_tokens, len(new.prompt_token_ids)
            )
            self._add(new.req_id)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_ids = cached.new_block_ids[i]
            if req_id in resumed_ids(cached):
                state.block_ids = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for ids, more in zip(state.block_ids, new_ids):
                    ids.extend(more)
            if req_id not in self.req_ids:
                self._add(req_id)


def resumed_ids(cached) -> set[str]:
    if hasattr(cached, "resumed_req_ids"):
        return set(cached.resumed_req_ids)
    return {r for r, resumed in zip(cached.req_ids, cached.resumed_from_preemption) if resumed}


# ---------------------------------------------------------------------------------------------
# What one launch sends, checked
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pair:
    src: int
    dst: int
    size: int


@dataclasses.dataclass
class Counts:
    launches: int = 0
    pairs: int = 0
    bytes: int = 0
    same_block: int = 0  # source and destination in one state block (the in-place conv shift)
    self_identical: int = 0  # src == dst
    self_left: int = 0  # dst < src < dst + size (the conv shift's shape)
    self_right: int = 0  # src < dst < src + size
    interacting_pairs: int = 0  # a pair whose range meets another pair's range of the same launch
    outside_state: int = 0
    across_block: int = 0
    unaligned: int = 0  # a source or destination not 8-byte aligned (patch 4's case)
    null_src: int = 0  # a source in the null block
    null_dst: int = 0  # a destination in the null block
    free_block: int = 0
    src_new_block: int = 0  # a source block allocated in the step of the copy

    def add(self, other: Counts) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def locate(index: list[StateTensor], addr: int, size: int):
    """(state tensor, block id) of the state block holding the range's first byte, or None."""
    for t in index:
        offset = addr - t.base
        if 0 <= offset < t.num_blocks * t.block_stride and offset % t.block_stride < t.block_bytes:
            return t, offset // t.block_stride
    return None


def audit_launch(pairs: list[Pair], index, pool_state) -> Counts:
    c = Counts(launches=1 if pairs else 0, pairs=len(pairs), bytes=sum(p.size for p in pairs))
    for p in pairs:
        if p.size == 0:
            continue
        if p.src == p.dst:
            c.self_identical += 1
        elif p.dst < p.src < p.dst + p.size:
            c.self_left += 1
        elif p.src < p.dst < p.src + p.size:
            c.self_right += 1
        c.unaligned += bool((p.src | p.dst) & 7)
        src_at, dst_at = locate(index, p.src, p.size), locate(index, p.dst, p.size)
        c.same_block += src_at is not None and src_at == dst_at
        for addr, where in ((p.src, src_at), (p.dst, dst_at)):
            if where is None:
                c.outside_state += 1
                continue
            tensor, block = where
            offset = addr - tensor.base - block * tensor.block_stride
            if offset + p.size > tensor.block_bytes:
                c.across_block += 1
            status = pool_state(block)
            c.null_src += status == "null" and addr == p.src
            c.null_dst += status == "null" and addr == p.dst
            c.free_block += status == "free"
            c.src_new_block += status == "new" and addr == p.src
    c.interacting_pairs = count_interacting(pairs)
    return c


def count_interacting(pairs: list[Pair]) -> int:
    """Pairs whose source or destination range meets the destination range of another pair."""
    events = []
    for i, p in enumerate(pairs):
        if p.size:
            events.append((p.dst, p.dst + p.size, i, "dst"))
            events.append((p.src, p.src + p.size, i, "src"))
    events.sort()
    hit, active = set(), []
    for start, end, i, kind in events:
        active = [a for a in active if a[0] > start]
        for a_end, j, a_kind in active:
            if j != i and "dst" in (kind, a_kind):
                hit.update((i, j))
        active.append((end, i, kind))
    return len(hit)


def pairs_from_tables(copy_bufs, start: int, end: int) -> list[Pair]:
    src = copy_bufs.src_ptrs.np[start:end]
    dst = copy_bufs.dst_ptrs.np[start:end]
    sizes = copy_bufs.sizes.np[start:end]
    return [Pair(int(s) % (1 << 64), int(d) % (1 << 64), int(n)) for s, d, n in zip(src, dst, sizes)]


def pair_of_views(src, dst) -> Pair:
    return Pair(src.data_ptr(), dst.data_ptr(), src.numel() * src.element_size())


# ---------------------------------------------------------------------------------------------
# One scenario
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    scenario: str
    binding: str
    layout: str
    drafter: str  # "mtp": every decoding request gets NUM_SPEC drafts; "ngram": 0..NUM_SPEC
    num_spec: int
    steps: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    launches: dict[str, Counts] = dataclasses.field(default_factory=dict)
    examples: dict[str, list] = dataclasses.field(default_factory=dict)

    def record(self, path: str, counts: Counts, pairs, index) -> None:
        self.launches.setdefault(path, Counts()).add(counts)
        odd = counts.self_left + counts.self_right + counts.interacting_pairs + counts.outside_state
        if odd and len(self.examples.setdefault(path, [])) < 3:
            self.examples[path].append([describe(p, index) for p in pairs][:8])


def describe(p: Pair, index) -> dict:
    out = {"bytes": p.size}
    for side, addr in (("src", p.src), ("dst", p.dst)):
        where = locate(index, addr, p.size)
        out[side] = (
            None
            if where is None
            else f"{where[0].layer}.{where[0].kind}[{where[1]}]+{(addr - where[0].base) % where[0].block_stride}"
        )
    return out


def run_scenario(scenario: Scenario, binding: str, layout: str, drafter: str, seed: int) -> Result:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker import mamba_utils

    from vllm_ascend.patch.worker import patch_mamba_utils as pmu

    rng = random.Random(seed)
    config = vllm_config(scenario)
    kv_config = kv_cache_config(scenario.num_blocks)
    config.cache_config.num_gpu_blocks = scenario.num_blocks
    scheduler = Scheduler(config, kv_config, StructuredOutputManager(config), block_size=BLOCK_SIZE)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    context, index = state_tensors(scenario.num_blocks, layout)
    copy_funcs = state_copy_funcs(kv_config)
    make = lambda n, dtype: CpuGpuBuffer(n, dtype=dtype, device="cpu", pin_memory=False)  # noqa: E731
    copy_bufs = mamba_utils.MambaCopyBuffers.create(scenario.max_num_seqs, kv_config, copy_funcs, make)
    align_ctx = make_align_ctx(mamba_utils, scenario.max_num_seqs, kv_config, copy_funcs, make)
    batch = Batch(scenario.max_num_seqs + 8)
    mamba_state_idx: dict[str, int] = {}
    block_pool = scheduler.kv_cache_manager.block_pool
    result = Result(scenario.name, binding, layout, drafter, NUM_SPEC)
    prefixes = collections.defaultdict(lambda: [rng.randrange(VOCAB) for _ in range(4096)])
    pending = sorted(enumerate(scenario.arrivals), key=lambda a: a[1].step)
    kda = KdaFallback.create(context[layer_name(1, 0)].kv_cache[1], scenario.max_num_seqs + 8)

    with bound(pmu, mamba_utils, binding) as recorded:
        for step in itertools.count():
            while pending and pending[0][1].step <= step:
                i, a = pending.pop(0)
                head = prefixes[a.prefix][: a.prefix_len] if a.prefix >= 0 else []
                prompt = head + [rng.randrange(VOCAB) for _ in range(a.prompt_len - len(head))]
                params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
                scheduler.add_request(Request(f"r{i}", prompt, params, None, block_hasher=hasher))
            if not pending and not scheduler.has_unfinished_requests():
                break
            so = scheduler.schedule()
            result.steps += 1
            result.preemptions += len(so.preempted_req_ids or ())
            result.prefix_hit_tokens += sum(r.num_computed_tokens for r in so.scheduled_new_reqs)
            batch.update(so)
            pool_state = block_status(block_pool, so)

            recorded.clear()
            pmu.preprocess_mamba(
                so, kv_config, config.cache_config, mamba_state_idx, batch, batch.requests, context, copy_funcs,
                copy_bufs,
            )  # fmt: skip
            for path, pairs in launches_of_preprocess(pmu, copy_bufs, recorded, binding):
                result.record(path, audit_launch(pairs, index, pool_state), pairs, index)

            # The model: each scheduled request accepts 1..1+drafts tokens; a prefill chunk short of
            # its prompt returns none.
            n = len(batch.req_ids)
            sampled = []
            for req_id in batch.req_ids:
                state = batch.requests[req_id]
                done = state.num_computed_tokens + so.num_scheduled_tokens[req_id]
                drafts = len(so.scheduled_spec_decode_tokens.get(req_id, ()))
                count = 0 if done < state.num_prompt_tokens else rng.randint(1, 1 + drafts)
                sampled.append([rng.randrange(VOCAB) for _ in range(count)])
            # The runner counts the sampler's valid tokens: a partial prefill's token is sampled, then discarded.
            accepted = torch.tensor([max(1, len(s)) for s in sampled] + [1] * (batch.num_accepted_tokens_cpu.size - n))
            stage_postprocess(mamba_utils, align_ctx, so, batch, mamba_state_idx)
            recorded.clear()
            pmu._postprocess_mamba_align_gpu_cpu_fallback(
                bufs=types.SimpleNamespace(postprocess_align=align_ctx), num_reqs=n, num_accepted_tokens_gpu=accepted,
                num_accepted_tokens_cpu_tensor=batch.num_accepted_tokens_cpu_tensor, input_batch=batch,
                kv_cache_config=kv_config, forward_context=context, mamba_state_copy_funcs=copy_funcs,
            )  # fmt: skip
            post_pairs = [pair_of_views(s, d) for s, d in recorded.views]
            result.record("postprocess", audit_launch(post_pairs, index, pool_state), post_pairs, index)
            if kda is not None:  # Kimi's prefill state gather and scatter through the KDA byte-copy fallback
                for path, pairs in kda.launches(running_state_blocks(batch, mamba_state_idx)):
                    result.record(path, audit_kda_launch(pairs, kda, index, pool_state), pairs, index)

            out = ModelRunnerOutput(
                req_ids=list(batch.req_ids), req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
                sampled_token_ids=sampled,
            )  # fmt: skip
            scheduler.update_from_output(so, out)
            decoding = [r for r, s in zip(batch.req_ids, sampled) if s and r in scheduler.requests]
            if decoding:
                lengths = [NUM_SPEC if drafter == "mtp" else rng.randint(0, NUM_SPEC) for _ in decoding]
                drafts = [[rng.randrange(VOCAB) for _ in range(k)] for k in lengths]
                scheduler.update_draft_token_ids(DraftTokenIds(decoding, drafts))
            if step > 100_000:
                raise RuntimeError(f"{scenario.name}: no progress")
    return result


def mamba_types(kv_config):
    from vllm.v1.kv_cache_interface import MambaSpec

    return {g.kv_cache_spec.mamba_type for g in kv_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)}


def state_copy_funcs(kv_config):
    """vLLM's two copy functions (conv, temporal): per Mamba type from vLLM 0.30, one tuple before."""
    from vllm.model_executor.layers.mamba import mamba_utils as layer_utils

    funcs = (layer_utils.get_conv_copy_spec, layer_utils.get_temporal_copy_spec)
    if hasattr(layer_utils, "MambaStateCopyFuncsByType"):
        return {m: funcs for m in mamba_types(kv_config)}
    return funcs


def make_align_ctx(mamba_utils, max_reqs, kv_config, copy_funcs, make):
    import inspect

    import torch

    create = mamba_utils.MambaSpecDecodeGPUContext.create
    kind = (
        {"copy_funcs": copy_funcs} if "copy_funcs" in inspect.signature(create).parameters else {"num_state_types": 2}
    )
    return create(
        max_num_reqs=max_reqs, kv_cache_config=kv_config, device=torch.device("cpu"), make_buffer=make, **kind
    )


def stage_postprocess(mamba_utils, ctx, so, batch, mamba_state_idx) -> None:
    mamba_utils.stage_postprocess_inputs_to_gpu(ctx, so, batch.req_ids, len(batch.req_ids), batch.requests,
                                                 mamba_state_idx)  # fmt: skip


def block_status(block_pool, so):
    """Status of a block id at the copy: "null", "free" (no request holds it), "new" (allocated this
    step: the model runner zeroes such blocks before the copy runs) or ""."""
    null_id = block_pool.null_block.block_id
    zeroed = getattr(so, "new_block_ids_to_zero", None)
    if zeroed is None:  # releases without it: every block newly allocated to a request this step
        new = {
            b for r in so.scheduled_new_reqs for ids in r.block_ids for b in ids[r.num_computed_tokens // BLOCK_SIZE :]
        }
        new |= {b for ids in so.scheduled_cached_reqs.new_block_ids for g in ids or () for b in g}
    else:
        new = set(zeroed)
    free = {b.block_id for b in block_pool.blocks if b.ref_cnt == 0}

    def status(block: int) -> str:
        if block == null_id:
            return "null"
        return "free" if block in free else "new" if block in new else ""

    return status


class Recorder:
    def __init__(self):
        self.views: list = []

    def clear(self) -> None:
        self.views.clear()


@contextlib.contextmanager
def bound(pmu, mamba_utils, binding: str):
    """Bind the release's collectors as its import binds them on `binding` hardware, and record.

    "pointer": A2/A3 (Triton batch memcpy: per-layer pointer tables, staged in preprocess);
    "310p": the tensor-pair collector and copy. The 310P fallback postprocess runs on both: it is the
    fused kernel's decision rule in Python.
    """
    recorder = Recorder()
    saved = {name: getattr(mamba_utils, name, None) for name in ("collect_mamba_copy_meta", "do_mamba_copy_block")}
    saved_can = getattr(pmu, "_can_launch_triton_batch_memcpy", None)
    view = pmu._tensor_view_from_data_ptr
    pending_src = []

    def recording_view(state, start_addr, num_elements):
        v = view(state, start_addr, num_elements)
        if pending_src:
            recorder.views.append((pending_src.pop(), v))
        else:
            pending_src.append(v)
        return v

    pmu._tensor_view_from_data_ptr = recording_view
    if binding == "pointer":
        mamba_utils.collect_mamba_copy_meta = getattr(
            pmu, "_collect_mamba_copy_meta_with_layers", saved["collect_mamba_copy_meta"]
        )
        can = True
    else:
        mamba_utils.collect_mamba_copy_meta = pmu._collect_mamba_copy_meta_torch
        can = False
    if saved_can is not None:
        pmu._can_launch_triton_batch_memcpy = lambda: can
    try:
        yield recorder
    finally:
        pmu._tensor_view_from_data_ptr = view
        for name, value in saved.items():
            setattr(mamba_utils, name, value)
        if saved_can is not None:
            pmu._can_launch_triton_batch_memcpy = saved_can


def launches_of_preprocess(pmu, copy_bufs, recorded, binding):
    """The launches the staged tables or collected pairs make: the bulk launch, and one per layer
    where the release stages per-layer slices (a layerwise KV-pool connector launches those)."""
    n = copy_bufs.offset
    if binding == "310p":
        pairs = [pair_of_views(s, d) for s, d in getattr(copy_bufs, "_tensor_copy_pairs", [])[:n]]
        recorded.views.clear()
        return [("preprocess_tensor_pairs", pairs)]
    out = [("preprocess_batch_memcpy", pairs_from_tables(copy_bufs, 0, n))]
    for layer, (start, end) in (getattr(copy_bufs, "_layer_copy_slices", None) or {}).items():
        out.append(("preprocess_layerwise", pairs_from_tables(copy_bufs, start, end)))
    return out


# ---------------------------------------------------------------------------------------------


def running_state_blocks(batch: Batch, mamba_state_idx: dict[str, int]) -> list[int]:
    """Each scheduled request's running-state block in the first Mamba group, as the model runner's
    state indices name it, then -1 rows as padding pads a batch."""
    blocks = [batch.requests[r].block_ids[1][mamba_state_idx[r]] for r in batch.req_ids]
    return blocks + [-1] * 4


class KdaFallback:
    """The release's `StridedKDAFallbackPlan` (A2/A3's KDA state gather and scatter through
    batch_memcpy_kernel) over one temporal state, its compiled launch recorded instead of run.

    `prepare` compiles on an NPU; the plan is assembled here with what `prepare` would store."""

    def __init__(self, module, plan, state):
        self.module, self.plan, self.state = module, plan, state
        self.calls: list[list[Pair]] = []
        self.packed: list[tuple[int, int]] = []  # the packed tensors' byte ranges

    @classmethod
    def create(cls, state, max_selected: int):
        try:
            from vllm_ascend.ops import kda_state_copy_plan as module
        except ImportError:  # a release without the KDA state copy
            return None
        plan = object.__new__(module.StridedKDAFallbackPlan)
        payload = state[0].numel() * state.element_size()
        plan._sealed, plan._signature = True, module.cache_signature(state)
        plan._max_selected, plan._state_bytes = max_selected, payload
        audit = cls(module, plan, state)
        plan._compiled = audit
        return audit

    def __getitem__(self, grid):  # `compiled[grid](src, dst, sizes)`, as the plan launches it
        def launch(src, dst, sizes):
            self.calls.append([Pair(int(a), int(b), int(n)) for a, b, n in zip(src, dst, sizes)])

        return launch

    def launches(self, blocks: list[int]):
        import torch

        self.calls.clear()
        indices = torch.tensor(blocks, dtype=torch.int64)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_attr(self.module, "batch_memcpy_kernel", _NoHooks()))
            stack.enter_context(_attr(torch, "npu", _NoDevice(), create=True))
            packed = self.plan.gather(self.state, indices, None)
            self.packed = [(packed.data_ptr(), packed.data_ptr() + packed.numel() * packed.element_size())]
            self.plan.scatter(self.state, packed, indices)
        return list(zip(("kda_fallback_gather", "kda_fallback_scatter"), self.calls))


class _NoHooks:
    pre_run_hooks: list = []


class _NoDevice:
    @staticmethod
    def device(_):
        return contextlib.nullcontext()


@contextlib.contextmanager
def _attr(obj, name, value, create=False):
    missing = object()
    old = getattr(obj, name, missing)
    if old is missing and not create:
        raise AttributeError(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


def audit_kda_launch(pairs: list[Pair], kda: KdaFallback, index, pool_state) -> Counts:
    """A KDA launch moves whole states between the cache and a packed tensor: the cache side is
    checked as audit_launch checks it, the packed side against the packed tensor; padding rows must
    move nothing."""
    live = [p for p in pairs if p.size]
    c = audit_launch([Pair(p.src, p.src, p.size) for p in live], index, pool_state)  # cache side only
    c.launches, c.pairs, c.self_identical, c.same_block = 1, len(pairs), 0, 0
    lo, hi = kda.packed[0]
    cache_side = [p.src if locate(index, p.src, p.size) else p.dst for p in live]
    packed_side = [p.dst if q == p.src else p.src for p, q in zip(live, cache_side)]
    c.outside_state = sum(not (lo <= a and a + p.size <= hi) for a, p in zip(packed_side, live))
    c.interacting_pairs = count_interacting(live)
    return c


def run(tree: Path, scale: int, seed: int, layout: str, num_specs=(NUM_SPEC,), drafters=("mtp", "ngram"),
        bindings=("pointer", "310p")) -> dict:  # fmt: skip
    import_tree(tree)
    import vllm

    import vllm_ascend

    if layout == "auto":  # the release's hybrid layout, where its 310P fallback can take it (see state_tensors)
        layout = "backing" if tuple(int(x) for x in vllm.__version__.split(".")[:2]) >= (0, 30) else "separate"
    results = []
    for num_spec, drafter, binding in itertools.product(num_specs, drafters, bindings):
        configure(num_spec)
        for scenario in scenarios(scale, random.Random(seed)):
            t = time.time()
            try:
                r = dataclasses.asdict(run_scenario(scenario, binding, layout, drafter, seed))
            except Exception as exc:  # the release's own code refused this layout or step: that is a finding
                r = {"scenario": scenario.name, "binding": binding, "layout": layout, "drafter": drafter,
                     "num_spec": num_spec, "launches": {}, "error": f"{type(exc).__name__}: {exc}"}  # fmt: skip
            results.append({**r, "seconds": round(time.time() - t, 1)})
    return {
        "tree": tree.name,
        "vllm": vllm.__version__,
        "vllm_ascend": str(Path(vllm_ascend.__file__).resolve().parents[1]),
        "scale": scale,
        "seed": seed,
        "layout": layout,
        "geometry": {
            "block_size": BLOCK_SIZE, "mamba_groups": NUM_MAMBA_GROUPS, "layers_per_group": LAYERS_PER_GROUP,
            "conv_width": CONV_WIDTH, "conv_dim": CONV_DIM, "temporal": TEMPORAL_SHAPE,
        },
        "results": results,
    }  # fmt: skip


def totals(record: dict) -> dict:
    """Counts per (path, binding, num_spec, drafter), summed over scenarios."""
    out: dict[str, Counts] = {}
    for r in record["results"]:
        for path, c in r["launches"].items():
            out.setdefault(f"{path} {r['binding']} spec={r['num_spec']} {r['drafter']}", Counts()).add(Counts(**c))
    return {k: dataclasses.asdict(v) for k, v in sorted(out.items())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, required=True, help="a materialized vllm-ascend tree (base or fork)")
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="scale 1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-spec", default="1,2,3", help="speculative token counts, comma-separated")
    parser.add_argument("--layout", choices=("auto", "backing", "shared", "separate"), default="auto")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    num_specs = tuple(int(n) for n in args.num_spec.split(","))
    record = run(args.tree.resolve(), 1 if args.smoke else args.scale, args.seed, args.layout, num_specs)
    record["totals"] = totals(record)
    for r in record["results"]:
        if "error" in r:
            print(
                f"{r['scenario']} {r['binding']} spec={r['num_spec']} {r['drafter']}: the release raised {r['error']}"
            )
    for key, c in record["totals"].items():
        odd = {k: v for k, v in c.items() if v and k not in ("launches", "pairs", "bytes")}
        print(f"{key:>46}: {c['launches']:>6} launches {c['pairs']:>7} pairs  {odd}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
