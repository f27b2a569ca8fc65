"""Where the Mamba copy tables are written, transferred and read, relative to synchronize_input_prep.

    COPY_AUDIT_TREE=build/base-0.30.0rc2 VENV/bin/python -m pytest -p no:cacheprovider benchmarks/table_lifetime.py

VENV: the CPU test environment of the tree's base (vLLM 0.30.0 for 0.30.0rc2, vLLM 0.23.0 for
0.23.0.post1). The tree's vllm_ascend is imported as upstream's CPU tests import it (its
tests/ut/conftest.py stubs torch_npu), and its patch_mamba_utils is re-bound per test for the
NPU or the 310P hardware profile and, in the fork, for each VLLM_ASCEND_MAMBA_COPY_BACKEND.

The pointer tables are ``MambaCopyBuffers.src_ptrs / dst_ptrs / sizes`` (pinned ``CpuGpuBuffer``s).
A *tape* records, per phase of a model-runner step, every change of their host (numpy) views,
every ``CpuGpuBuffer.copy_to_gpu`` (the non-blocking H2D) and every copy launch with the tables
it was handed (host views or device copies) and the rows it read. The phases follow the order in
which the model runner calls the functions driven here (line numbers: docs/table-lifetime.md):

    "window"   the body of ``with self.synchronize_input_prep():`` (preprocess_mamba, staging).
               Its exit records ``prepare_inputs_event``; the next step's entry waits on it.
    "forward"  after the window: the connector's prepare_mamba_state_copy, the bulk
               do_mamba_copy_block, the per-layer copies from wait_for_layer_load.
    "post"     _update_states_after_model_execute (the fused postprocess / the 310P fallback).

A table write or H2D in "window" is covered by the event: the next step rewrites the pinned
tables only after the device has passed them. One in "forward" is not: the event was recorded
before it. The pointer kernel cannot run on the CPU (Triton): the launch functions are replaced by
a recorder that copies with ``ctypes.memmove`` from the rows it was handed, so the states show
whether the launch read this step's tables.

Modes: (a) bulk, per copy backend; (b) the layerwise KV-pool connector (AscendStoreConnector's own
methods over a stand-in instance; 0.30.0rc2 only); (d) 310P; (e) the fused postprocess's staged
inputs and the accepted counts. (c) the V2 model runner's Mamba path is Triton launches over device
tensors only and is not driven here (docs/table-lifetime.md says what was read instead).
"""

import contextlib
import ctypes
import importlib
import importlib.util
import os
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import copy_audit

TREE = Path(os.environ.get("COPY_AUDIT_TREE", "build/fork")).resolve()
copy_audit.import_tree(TREE)  # the tree's vllm_ascend, as upstream's CPU tests import it

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402
from vllm.v1.utils import CpuGpuBuffer  # noqa: E402
from vllm.v1.worker import mamba_utils  # noqa: E402

import vllm_ascend.patch.worker.patch_mamba_utils as pm  # noqa: E402

assert Path(pm.__file__).resolve().is_relative_to(TREE), f"imported {pm.__file__}, not from {TREE}"
VLLM_030 = tuple(int(x) for x in vllm.__version__.split(".")[:2]) >= (0, 30)  # else vLLM 0.23
IS_FORK = hasattr(pm, "_MAMBA_COPY_BACKENDS")
LAYERWISE = hasattr(pm, "prepare_mamba_copy_by_layer")
VLLM_CREATE = classmethod(pm._original_create.__func__)  # vLLM's own, before the int64 remap wraps it


def _vllm_mamba_utils() -> dict:
    """vLLM's own module-level names of mamba_utils (the tree's import has replaced some): read from
    a fresh load of its file, the functions re-homed in the live module so they call what is bound."""
    spec = importlib.util.spec_from_file_location("_vllm_mamba_utils_fresh", mamba_utils.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    names = {}
    for name, value in vars(fresh).items():
        if isinstance(value, types.FunctionType) and value.__module__ == fresh.__name__:
            value = types.FunctionType(value.__code__, vars(mamba_utils), name, value.__defaults__, value.__closure__)
            value.__kwdefaults__ = vars(fresh)[name].__kwdefaults__
        if not name.startswith("__") and not isinstance(value, type):
            names[name] = value
    return names


VLLM_MAMBA_UTILS = _vllm_mamba_utils()
BACKENDS = ["torch", "memmove", "triton"] if IS_FORK else [None]
TABLES = ("src_ptrs", "dst_ptrs", "sizes")  # MambaCopyBuffers
# the fused postprocess's staged inputs (MambaSpecDecodeGPUContext)
STAGED = ("mamba_state_idx_buf", "num_scheduled_tokens_buf", "num_computed_tokens_buf", "num_draft_tokens_buf")

BLOCK_SIZE, NUM_SPEC_BLOCKS, NUM_BLOCKS, MAX_REQS = 4, 3, 32, 4
CONV, TEMPORAL = (6, 8), (2, 4, 4)  # (state_len, dim) fp16 (SD layout), fp32
LAYERS = {g: [f"model.layers.{g}{i}.linear_attn" for i in range(2)] for g in (1, 2, 3)}  # group 0: attention


# --------------------------------------------------------------------------------------------
# The tree's binding, re-run for a hardware profile and a copy backend
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def bound(monkeypatch, npu: bool, backend: str | None):
    """Re-import patch_mamba_utils as it binds on an NPU (A2/A3) or on 310P; undo it after."""
    saved_vllm, saved_pm = dict(vars(mamba_utils)), dict(vars(pm))
    saved_create = vars(mamba_utils.MambaCopyBuffers)["create"]
    with monkeypatch.context() as mp:
        mp.delenv("GLM53_BATCH_MEMCPY", raising=False)
        mp.delenv("VLLM_ASCEND_MAMBA_COPY_BACKEND", raising=False)
        if backend:
            mp.setenv("VLLM_ASCEND_MAMBA_COPY_BACKEND", backend)
        if hasattr(pm, "get_current_hardware_profile"):  # 0.30.0rc2: hardware profile
            import vllm_ascend.device.hardware_profile as profile

            mp.setattr(profile, "get_current_hardware_profile", lambda: SimpleNamespace(supports=lambda _: npu))
        else:  # 0.23.0.post1: is_310p()
            import vllm_ascend.utils as ascend_utils

            mp.setattr(ascend_utils, "is_310p", lambda: not npu)
        try:
            for name in set(vars(mamba_utils)) - set(VLLM_MAMBA_UTILS):
                if not name.startswith("__") and not isinstance(vars(mamba_utils)[name], type):
                    delattr(mamba_utils, name)  # names the tree's binding added
            vars(mamba_utils).update(VLLM_MAMBA_UTILS)  # bind over vLLM's functions, as at start-up
            mamba_utils.MambaCopyBuffers.create = VLLM_CREATE  # else the reload wraps its own wrapper
            importlib.reload(pm)
            yield
        finally:
            vars(mamba_utils).update(saved_vllm)
            mamba_utils.MambaCopyBuffers.create = saved_create
            vars(pm).clear()
            vars(pm).update(saved_pm)


# --------------------------------------------------------------------------------------------
# The tape
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    kind: str  # "write" (a host view changed), "h2d" (copy_to_gpu), "launch"
    what: str  # a buffer name, or the launch function's name
    phase: str
    reads: tuple = ()  # launch: ("device:src_ptrs", ...) or ("host:src_ptrs", ...)


class Tape:
    def __init__(self, buffers: dict[str, CpuGpuBuffer]):
        self.buffers, self.events, self.phase = buffers, [], "setup"
        self.seen = {name: buf.np.copy() for name, buf in buffers.items()}
        self.transferred = {}  # name: the host rows the last H2D carried
        self.launched_rows = []  # [(src, dst, size)] as the launches read them

    def notice_writes(self) -> None:
        for name, buf in self.buffers.items():
            if not np.array_equal(buf.np, self.seen[name]):
                self.events.append(Event("write", name, self.phase))
                self.seen[name] = buf.np.copy()

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        self.notice_writes()
        self.phase = phase
        yield
        self.notice_writes()

    def name_of(self, buf) -> str:
        return next((n for n, b in self.buffers.items() if b is buf), "other")

    def transfer(self, buf, n) -> None:
        self.notice_writes()
        name = self.name_of(buf)
        self.events.append(Event("h2d", name, self.phase))
        self.transferred[name] = buf.np[:n].copy()

    def source(self, tensor: torch.Tensor) -> str:
        storage = tensor.untyped_storage().data_ptr()
        for name, buf in self.buffers.items():
            for side in ("gpu", "cpu"):
                if getattr(buf, side).untyped_storage().data_ptr() == storage:
                    return ("device:" if side == "gpu" else "host:") + name
        return "other"

    def launch(self, what: str, tensors) -> None:
        self.notice_writes()
        self.events.append(Event("launch", what, self.phase, tuple(self.source(t) for t in tensors)))

    def where(self, kind: str, names=TABLES) -> set:
        return {e.phase for e in self.events if e.kind == kind and e.what in names}

    def launches(self) -> list:
        return [e for e in self.events if e.kind == "launch"]


@contextlib.contextmanager
def taped(world):
    """A tape over the world's tables; copy_to_gpu and the tree's pointer launches report to it."""
    tape = Tape(world.tables())
    real_copy_to_gpu = CpuGpuBuffer.copy_to_gpu

    def copy_to_gpu(buf, n=None):
        tape.transfer(buf, n)
        return real_copy_to_gpu(buf, n)

    def pointer_launch(name):
        def run(src_ptrs, dst_ptrs, sizes, **_):
            tape.launch(name, (src_ptrs, dst_ptrs, sizes))
            rows = list(zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()))
            tape.launched_rows += rows
            for src, dst, size in rows:  # what the kernel does, from the rows it was handed
                ctypes.memmove(dst, src, size)

        return run

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CpuGpuBuffer, "copy_to_gpu", copy_to_gpu)
        # every name the tree's pointer launches go through, as bound
        if mamba_utils.batch_memcpy is pm._batch_memcpy_triton:  # 0.23.0.post1: vLLM's do_mamba_copy_block
            mp.setattr(mamba_utils, "batch_memcpy", pointer_launch("batch_memcpy"))
        mp.setattr(pm, "_batch_memcpy_triton", pointer_launch("_batch_memcpy_triton"))
        if hasattr(pm, "batch_memmove"):
            mp.setattr(pm, "batch_memmove", pointer_launch("batch_memmove"))
        yield tape


# --------------------------------------------------------------------------------------------
# A hybrid model's caches and one step's requests
# --------------------------------------------------------------------------------------------


def _make_buffer(*size, dtype):
    return CpuGpuBuffer(*size, dtype=dtype, device=torch.device("cpu"), pin_memory=False)


class World:
    """One attention group and three Mamba groups of two layers; per layer a conv and a temporal pool."""

    def __init__(self):
        spec = MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=(CONV, TEMPORAL),
            dtypes=(torch.float16, torch.float32),
            mamba_cache_mode="align",
            num_speculative_blocks=NUM_SPEC_BLOCKS,
        )
        attention = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16)
        groups = [KVCacheGroupSpec(["model.layers.0.self_attn"], attention)]
        groups += [KVCacheGroupSpec(list(names), spec) for names in LAYERS.values()]
        self.kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
        gen = torch.Generator().manual_seed(0)
        self.forward_context = {
            name: SimpleNamespace(
                kv_cache=[
                    torch.randn(NUM_BLOCKS, *CONV, generator=gen).half(),
                    torch.randn(NUM_BLOCKS, *TEMPORAL, generator=gen),
                ]
            )
            for names in LAYERS.values()
            for name in names
        }
        funcs = (get_conv_copy_spec, get_temporal_copy_spec)
        self.copy_funcs = {spec.mamba_type: funcs} if VLLM_030 else funcs
        self.bufs = mamba_utils.MambaBuffers.create(
            max_num_reqs=MAX_REQS,
            kv_cache_config=self.kv_cache_config,
            copy_funcs=self.copy_funcs,
            make_buffer=_make_buffer,
            device=torch.device("cpu"),
            with_postprocess_align=True,
        )
        self.step_inputs()

    def step_inputs(self):
        """Two requests cross into a new block (one shifted by an accepted draft), one stays."""
        ids = ("shift", "new", "stay")
        # group 0 (attention) is never visited; Mamba group g: request k owns blocks 10k+g .. 10k+g+6
        blocks = {r: tuple([90 + k] if g == 0 else list(range(10 * k + g, 10 * k + g + 7)) for g in range(4))
                  for k, r in enumerate(ids)}  # fmt: skip
        computed, scheduled = {"shift": 8, "new": 5, "stay": 9}, {"shift": 4, "new": 4, "stay": 2}
        self.requests = {r: SimpleNamespace(num_computed_tokens=computed[r], block_ids=blocks[r]) for r in ids}
        self.mamba_state_idx = {"shift": 1, "stay": 2}  # "new" derives block 1 from its computed tokens
        self.scheduler_output = SimpleNamespace(
            finished_req_ids=set(),
            preempted_req_ids=set(),
            scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
            num_scheduled_tokens=scheduled,
            scheduled_spec_decode_tokens={"shift": [7, 7, 7], "new": [7, 7, 7], "stay": [7]},
        )
        tables = {g: np.array([blocks[r][g] for r in ids]) for g in range(4)}
        self.input_batch = SimpleNamespace(
            req_ids=list(ids),
            num_accepted_tokens_cpu=np.array([2, 1, 1], dtype=np.int32),
            block_table={g: SimpleNamespace(get_numpy_array=lambda t=t: t) for g, t in tables.items()},
        )
        # (request, source block index, destination block index, accepted-token bias) of the moves
        self.moves = [("shift", 1, 2, 1), ("new", 1, 2, 0)]

    def expected_states(self) -> dict:
        """The states after the step's moves, as vLLM's copy specs describe them (dst gets src's tail)."""
        out = {}
        for g, names in LAYERS.items():
            for name in names:
                conv, temporal = (s.clone() for s in self.forward_context[name].kv_cache)
                for req, src, dst, bias in self.moves:
                    ids = self.requests[req].block_ids[g]
                    tail = conv[ids[src]].flatten()[bias * CONV[1] :].clone()
                    conv[ids[dst]].view(-1)[: tail.numel()] = tail  # the conv rows shifted by the bias
                    temporal[ids[dst]] = temporal[ids[src + bias]].clone()  # the last accepted token's state
                out[name] = (conv, temporal)
        return out

    def assert_states(self, expected: dict) -> None:
        for name, (conv, temporal) in expected.items():
            got_conv, got_temporal = self.forward_context[name].kv_cache
            assert torch.equal(got_conv, conv) and torch.equal(got_temporal, temporal), name

    def tables(self) -> dict:
        pre, post = self.bufs.preprocess, self.bufs.postprocess_align
        found = {name: getattr(pre, name) for name in TABLES}
        for name in STAGED:
            found[name] = getattr(post, name)
        return found


def preprocess(world: World) -> None:
    """The runner's call, inside synchronize_input_prep (the tree's preprocess_mamba, as bound)."""
    mamba_utils.preprocess_mamba(
        world.scheduler_output,
        world.kv_cache_config,
        SimpleNamespace(enable_prefix_caching=True, mamba_cache_mode="align"),
        world.mamba_state_idx,
        world.input_batch,
        world.requests,
        world.forward_context,
        world.copy_funcs,
        world.bufs.preprocess,
    )


def stage_postprocess(world: World) -> None:
    mamba_utils.stage_postprocess_inputs_to_gpu(
        world.bufs.postprocess_align,
        world.scheduler_output,
        world.input_batch.req_ids,
        len(world.input_batch.req_ids),
        world.requests,
        world.mamba_state_idx,
    )


@contextlib.contextmanager
def one_step(monkeypatch, npu: bool, backend: str | None):
    """A world and a tape, under the tree's binding for a hardware profile and a copy backend."""
    with bound(monkeypatch, npu, backend):
        world = World()
        with taped(world) as tape:
            yield world, tape


def pointer_launches(tape: Tape) -> list:
    return [e for e in tape.launches() if e.reads]


def assert_launches_read_device_tables(tape: Tape) -> None:
    """Every pointer launch was handed device copies, and read the rows staged for this step."""
    assert pointer_launches(tape), "no pointer launch"
    for event in pointer_launches(tape):
        assert set(event.reads) == {f"device:{name}" for name in TABLES}, event
    staged = set(zip(*(tape.transferred[name].tolist() for name in TABLES)))
    assert set(tape.launched_rows) == staged


# --------------------------------------------------------------------------------------------
# (a) bulk: no KV connector; do_mamba_copy_block after the window
# --------------------------------------------------------------------------------------------

# The phase of the pointer tables' H2D on the NPU pointer paths: 0.30.0rc2 stages them inside
# preprocess_mamba; 0.23.0.post1 sends them from do_mamba_copy_block, after the window.
POINTER_TRANSFER_PHASE = "window" if VLLM_030 else "forward"
STOCK = "triton" if IS_FORK else None  # the stock pointer launch


@pytest.mark.parametrize("backend", BACKENDS)
def test_bulk_copy(monkeypatch, backend):
    with one_step(monkeypatch, npu=True, backend=backend) as (world, tape):
        expected = world.expected_states()
        with tape.in_phase("window"):
            preprocess(world)
        with tape.in_phase("forward"):
            mamba_utils.do_mamba_copy_block(world.bufs.preprocess)
    world.assert_states(expected)
    if backend == "torch":  # grouped tensor copies: the pointer tables are neither written nor sent
        assert tape.where("write") == tape.where("h2d") == set()
        assert pointer_launches(tape) == []
        return
    assert tape.where("write") == {"window"}
    assert tape.where("h2d") == {POINTER_TRANSFER_PHASE}
    assert_launches_read_device_tables(tape)


def test_bulk_tables_leave_the_host_before_the_window_closes_only_on_0_30(monkeypatch):
    """0.30.0rc2 issues the tables' H2D before the window's event is recorded; 0.23.0.post1 after it,
    so that event does not order the next step's rewrite of the pinned tables behind the transfer."""
    with one_step(monkeypatch, npu=True, backend=STOCK) as (world, tape):
        with tape.in_phase("window"):
            preprocess(world)
        sent_in_window = tape.where("h2d")
        with tape.in_phase("forward"):
            mamba_utils.do_mamba_copy_block(world.bufs.preprocess)
    if VLLM_030:
        assert sent_in_window == tape.where("h2d") == {"window"}
    else:
        assert sent_in_window == set() and tape.where("h2d") == {"forward"}
    # either way, nothing rewrites the host tables between the transfer and the launch
    assert [e.kind for e in tape.events if e.what in TABLES and e.kind != "write"][-1] == "h2d"
    assert tape.launches()[-1].phase == "forward"


# --------------------------------------------------------------------------------------------
# (b) the layerwise KV-pool connector (0.30.0rc2)
# --------------------------------------------------------------------------------------------


def _store_connector():
    """The real AscendStoreConnector methods over a stand-in instance (no KV pool behind it)."""
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.ascend_store_connector import (
        AscendStoreConnector,
    )

    state = SimpleNamespace(
        requires_mamba_state_copy_after_layer_load=True,
        use_layerwise=True,
        connector_worker=SimpleNamespace(wait_for_layer_load=lambda: None),
        _mamba_copy_bufs=None,
        _mamba_state=None,
    )
    return SimpleNamespace(
        prepare=lambda bufs: AscendStoreConnector.prepare_mamba_state_copy(state, bufs),
        wait_for_layer_load=lambda name: AscendStoreConnector.wait_for_layer_load(state, name),
        finish=lambda: AscendStoreConnector.finish_mamba_state_copy(state),
    )


@pytest.mark.skipif(not LAYERWISE, reason="this base has no layerwise Mamba copy path")
@pytest.mark.parametrize("backend", BACKENDS)
def test_layerwise_copy(monkeypatch, backend):
    connector = _store_connector()
    with one_step(monkeypatch, npu=True, backend=backend) as (world, tape):
        expected = world.expected_states()
        with tape.in_phase("window"):
            preprocess(world)
        with tape.in_phase("forward"):
            assert connector.prepare(world.bufs.preprocess) is True
            tape.notice_writes()
            after_prepare = [e for e in tape.events if e.phase == "forward"]
            for names in LAYERS.values():
                for name in names:
                    connector.wait_for_layer_load(name)
            connector.finish()
    world.assert_states(expected)
    assert after_prepare == [], "prepare_mamba_state_copy wrote or sent tables after the window"
    if backend == "torch":
        assert tape.where("h2d") == set() and pointer_launches(tape) == []
        return
    assert tape.where("write") == tape.where("h2d") == {"window"}
    assert len(pointer_launches(tape)) == sum(map(len, LAYERS.values()))  # one launch per layer
    assert_launches_read_device_tables(tape)


@pytest.mark.skipif(LAYERWISE, reason="this base has a layerwise Mamba copy path")
def test_no_layerwise_copy_path(monkeypatch):
    with bound(monkeypatch, npu=True, backend=STOCK):
        assert not hasattr(mamba_utils, "do_mamba_copy_block_for_layer")
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import ascend_store_connector

    assert not hasattr(ascend_store_connector.AscendStoreConnector, "prepare_mamba_state_copy")


# --------------------------------------------------------------------------------------------
# (d) 310P: tensor pairs, no pointer table sent
# --------------------------------------------------------------------------------------------


def test_310p_copy(monkeypatch):
    with one_step(monkeypatch, npu=False, backend=None) as (world, tape):
        expected = world.expected_states()
        with tape.in_phase("window"):
            preprocess(world)
        with tape.in_phase("forward"):
            mamba_utils.do_mamba_copy_block(world.bufs.preprocess)
    world.assert_states(expected)
    assert tape.where("write", ["src_ptrs", "dst_ptrs"]) == set()
    assert tape.where("write", ["sizes"]) == {"window"}  # the collector's byte counts, never sent
    assert tape.where("h2d") == set()
    assert tape.launches() == []


# --------------------------------------------------------------------------------------------
# (e) the fused postprocess's staged inputs, and the accepted counts coming back
# --------------------------------------------------------------------------------------------


def _postprocess(world: World, num_accepted: torch.Tensor, out: torch.Tensor) -> None:
    mamba_utils.postprocess_mamba_align_gpu(
        bufs=world.bufs,
        num_reqs=len(world.input_batch.req_ids),
        num_accepted_tokens_gpu=num_accepted,
        num_accepted_tokens_cpu_tensor=out,
        input_batch=world.input_batch,
        kv_cache_config=world.kv_cache_config,
        forward_context=world.forward_context,
        mamba_state_copy_funcs=world.copy_funcs,
    )


def test_postprocess_inputs_staged_in_window_and_read_on_device(monkeypatch):
    with one_step(monkeypatch, npu=True, backend=STOCK) as (world, tape):
        ctx = world.bufs.postprocess_align
        ctx.is_initialized = True  # its device metadata (state addresses) is set once, not per step

        def fused_postprocess(**kwargs):  # the Triton launch, recorded; it leaves the counts in its output
            tape.launch("run_fused_postprocess", [v for v in kwargs.values() if isinstance(v, torch.Tensor)])
            n = kwargs["num_reqs"]
            ctx.num_accepted_tokens_out[:n] = kwargs["num_accepted_tokens_gpu"][:n]

        monkeypatch.setattr(ctx, "run_fused_postprocess", fused_postprocess)
        with tape.in_phase("window"):
            preprocess(world)
            stage_postprocess(world)
        with tape.in_phase("post"):
            out = torch.zeros(4, dtype=torch.int64)
            _postprocess(world, torch.tensor([3, 1, 2, 1]), out)
    assert tape.where("write", STAGED) == tape.where("h2d", STAGED) == {"window"}
    (launch,) = [e for e in tape.launches() if e.what == "run_fused_postprocess"]
    assert {r for r in launch.reads if r != "other"} == {f"device:{name}" for name in STAGED}
    assert out[:3].tolist() == [3, 1, 2]  # the D2H lands in the runner's own tensor, after the window


def test_310p_postprocess_rewrites_no_staged_table(monkeypatch):
    """310P's fallback decides from the staged host views after the window, and writes none of them."""
    with one_step(monkeypatch, npu=False, backend=None) as (world, tape):
        with tape.in_phase("window"):
            preprocess(world)
            stage_postprocess(world)
        with tape.in_phase("post"):
            out = torch.zeros(4, dtype=torch.int64)
            _postprocess(world, torch.tensor([1, 1, 1, 1]), out)
    assert tape.where("write", STAGED) == tape.where("h2d", STAGED) == {"window"}
    assert tape.where("write") == {"window"} and tape.where("h2d") == set()
    assert out[:3].tolist() == [1, 1, 1]
