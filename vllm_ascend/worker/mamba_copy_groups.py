# SPDX-License-Identifier: Apache-2.0
"""Grouped copies of align-mode Mamba state moves (the ``torch`` path).

Moves: a request moves the states of every layer of a KV-cache group
with the same block ids, so ``record`` keeps one ``Move`` per request
and group instead of a tensor pair per layer and state.
Layout: the layers of a group that one storage holds at one stride
(all of them when one allocation holds every layer) form a *family*,
with other groups' layers at the same places, seen as (layers, rows,
row): a move is the same rows in every layer. A *row* is the gcd of
every offset and size in the storage (``Shape.row_bytes``), not a
conv state's token (``State.token_bytes``). Other layouts: ``record``
says False and the caller copies pair by pair.
Hazards: moves whose blocks interact go pair by pair, in order; the
rest touch blocks no other move touches, and only a conv state
shifted inside its own block overlaps itself.
Strategies: a small step (``_is_small_step``) is one ``_foreach_copy_``
of views spanning a family's layers (shifted sources staged first).
A larger one, or a small one whose staging would pass the cap,
gathers rows into a buffer (``index_select``) and scatters them
(``index_copy_``) chunk by chunk: a chunk reads before it writes, and
shifts go to lower rows, so no chunk reads what an earlier one wrote.
Memory: staging, gather buffer and row indices stay under
``GATHER_BYTES``, with one exception: row indices over half the cap
are kept whole and the buffer gets half the cap (or one row), so the
total is the indices plus half the cap.
A new state kind: ``_kind`` names it, ``_rows`` gives its byte ranges
and ``_copy_pair_by_pair`` its tensor pair (``Move`` if it reads a
block no field names yet).
"""

import math
from collections import namedtuple
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.model_executor.layers.mamba import mamba_utils as vllm_mamba

from vllm_ascend.worker.mamba_copy_checks import conflicting_pairs

GATHER_BYTES = 64 << 20  # the most bytes of temporaries a step holds
DIRECT_PAIRS_PER_FAMILY = 4  # see _is_small_step
INDEX_BYTES = 16  # a row's source and destination index (int64)
_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

Layer = namedtuple("Layer", "name group states funcs")  # mamba_layers()
Move = namedtuple("Move", "group bias conv_src temporal_src dst")  # block ids
COLUMN = Move(*range(len(Move._fields)))  # a field's column in a table
BLOCKS = [COLUMN.conv_src, COLUMN.temporal_src, COLUMN.dst]
# A state, in bytes from its layer's first byte in the storage.
State = namedtuple("State", "kind offset block_stride block_bytes token_bytes")
# Families alike (layer_rows: from one layer to the next) share rows.
Shape = namedtuple("Shape", "row_bytes states layers layer_rows groups")
# A family's rows as (layers x rows, row elements), (layers, elements).
Family = namedtuple("Family", "shape by_row by_layer")
Place = namedtuple("Place", "family layer group")  # None: all of them
Ranges = namedtuple("Ranges", "src dst length group")  # rows or elements
# index: (2, layers x rows) source, destination rows, layer by layer;
# per_layer: a layer's columns; groups: {g: (first, end)} in a layer's
RowIndex = namedtuple("RowIndex", "index per_layer groups")


@dataclass
class Plan:  # how one step's moves are copied (once a step)
    moves: list  # the step's Moves, by identity
    serial: list  # Moves that interact: pair by pair
    pending: set  # layers the layerwise path has not copied
    direct: dict | None = None  # Shape: (unstaged, staged) Ranges
    indexed: dict | None = None  # Shape: RowIndex
    buffer: torch.Tensor | None = None


@dataclass
class GroupedCopies:  # what the copy buffers keep
    signature: list | None = None  # pointers, shapes, copy functions
    families: list | None = None  # None: a layout not known here
    places: dict = field(default_factory=dict)  # name: [Place]
    num_blocks: int = 0
    layers: list = field(default_factory=list)  # the step's
    plan: Plan | None = None


def _kind(func, state: torch.Tensor) -> str | None:
    if state.dim() < 2 or not state[0].is_contiguous():
        return None
    if func is vllm_mamba.get_temporal_copy_spec:
        return "temporal"
    # vLLM's DS conv layout (dim first) does not shift by tokens
    dim_first = getattr(vllm_mamba, "is_conv_state_dim_first", bool)()
    conv = func is vllm_mamba.get_conv_copy_spec
    return "conv" if conv and not dim_first else None


def _layer_states(states, kinds) -> tuple[int, tuple] | None:
    """(first byte, States) of states disjoint in one block stride."""
    first = min(s.data_ptr() for s in states)
    found = []
    for s, k in zip(states, kinds):
        elements = (s.stride(0), s[0].numel(), s.stride(1))
        nbytes = (n * s.element_size() for n in elements)
        found.append(State(k, s.data_ptr() - first, *nbytes))
    spans = sorted((s.offset, s.offset + s.block_bytes) for s in found)
    stride = found[0].block_stride
    starts = [start for start, _ in spans[1:]] + [stride]
    fits = all(end <= start for (_, end), start in zip(spans, starts))
    alike = all(s.block_stride == stride for s in found)
    return (first, tuple(found)) if fits and alike else None


def _storages(layers: list[Layer]) -> dict | None:
    """Per storage: [storage, row bytes (the gcd of every offset and
    size in it), {(group, States): [(first byte, layer name)]}]."""
    found: dict[int, list] = {}
    for name, group, states, funcs in layers:
        parts: dict[int, list] = {}
        for s, func in zip(states, funcs):
            ptr = s.untyped_storage().data_ptr()
            parts.setdefault(ptr, []).append((s, _kind(func, s)))
        for ptr, part in parts.items():
            if (placed := _layer_states(*zip(*part))) is None:
                return None
            first, layer_states = placed[0] - ptr, placed[1]
            storage = found.setdefault(ptr, [part[0][0].untyped_storage(), 0, {}])
            storage[2].setdefault((group, layer_states), []).append((first, name))
            sizes = [n for s in layer_states for n in s[1:]]
            storage[1] = math.gcd(storage[1], first, *sizes)
    return found


def _discover(copies: GroupedCopies, layers: list[Layer]) -> None:
    """Find the families and places of the layers (or leave None)."""
    if (storages := _storages(layers)) is None:
        return
    # one element type for all: one gather buffer serves every family
    rows = [row for _, row, _ in storages.values()]
    unit = max(u for u in _DTYPES if all(row % u == 0 for row in rows))
    runs: dict[tuple, dict] = {}  # alike at one stride: {group: names}
    for storage, row, members in storages.values():
        size = storage.nbytes() // row * row
        for (group, states), at in members.items():
            firsts, names = zip(*sorted(at))
            count = len(firsts)
            stride = firsts[1] - firsts[0] if count > 1 else size - firsts[0]
            steps = np.diff(firsts).tolist()
            if steps != [stride] * (count - 1) or firsts[0] + count * stride > size:
                return  # not at one layer stride
            key = (storage, row, states, firsts[0], stride, count)
            runs.setdefault(key, {})[group] = names
    copies.families, copies.places = [], {}
    for (storage, row, states, first, stride, count), groups in runs.items():
        flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        data = flat[first : first + count * stride].view(_DTYPES[unit])
        stack = data.view(count, stride // row, -1)
        layer_rows = stride // row if count > 1 else 0
        shape = Shape(row, states, count, layer_rows, tuple(sorted(groups)))
        family = Family(shape, stack.view(-1, stack.shape[2]), stack.view(count, -1))
        copies.families.append(family)
        for group, names in groups.items():
            for i, name in enumerate(names):
                copies.places.setdefault(name, []).append(Place(family, i, group))
    copies.num_blocks = min(s.shape[0] for layer in layers for s in layer.states)


def record(copy_bufs, mamba_layers, mamba_group_ids, src_block_idx, dest_block_idx, accept_token_bias, req_state):
    """Record a request's moves; False: not a layout known here.
    ``mamba_layers()``: (name, group, states, copy functions) a layer."""
    if not hasattr(copy_bufs, "_mamba_copy_groups"):
        copy_bufs._mamba_copy_groups = GroupedCopies()
    copies = copy_bufs._mamba_copy_groups
    if not getattr(copy_bufs, "_mamba_copy_requests", None):  # a new step
        copies.layers = [Layer(*layer) for layer in mamba_layers()]
        copy_bufs._mamba_copy_requests = []
        copies.plan = None  # a layerwise step left unfinished
        pairs = [(s, f) for layer in copies.layers for s, f in zip(layer.states, layer.funcs)]
        signature = [(s.data_ptr(), s.shape, s.stride(), s.dtype, f) for s, f in pairs]
        if signature != copies.signature:  # new KV-cache tensors
            copies.signature, copies.families = signature, None
            if all(_kind(f, s) for s, f in pairs):
                _discover(copies, copies.layers)
    if copies.families is None:
        return False  # the layout is the step's: no request of it is grouped
    if accept_token_bias < 0:
        # vLLM never shifts backwards; declining one request would mix
        # grouped and per-pair requests in a step, out of pair order
        raise ValueError(f"Mamba state move with a negative shift: {accept_token_bias}")
    src, bias = src_block_idx, accept_token_bias
    for group in mamba_group_ids:
        ids = req_state.block_ids[group]
        move = Move(group, bias, ids[src], ids[src + bias], ids[dest_block_idx])
        copy_bufs._mamba_copy_requests.append(move)
    metadata = getattr(copy_bufs, "_layer_copy_metadata", None)
    if metadata is not None:
        for layer in copies.layers:  # the layers to visit
            metadata.setdefault(layer.name, ([], [], []))
    return True


def _interacting(blocks: np.ndarray) -> np.ndarray:
    """Moves whose blocks (columns as ``BLOCKS``) another move touches
    in a way that orders them."""
    each = np.sort(blocks, axis=1)
    each = each[np.diff(each, axis=1, prepend=-1) != 0]  # blocks once
    if np.unique(each).size == each.size:  # no block shared: none
        return np.zeros(len(blocks), dtype=bool)
    conv, temporal, dst = blocks.T
    owners = np.tile(np.arange(len(blocks)), 2)
    src, dst = np.concatenate([conv, temporal]), np.tile(dst, 2)
    pairs = conflicting_pairs(src, dst, np.ones_like(owners), owners)
    return pairs[: len(blocks)] | pairs[len(blocks) :]


def _rows(table: np.ndarray, shape: Shape) -> Ranges:
    """One layer's row ranges of the moves, group by group."""
    mine = np.zeros(len(table), dtype=bool)
    for group in shape.groups:  # np.isin costs ~30 us a call on small arrays
        mine |= table[:, COLUMN.group] == group
    table, src, dst, nbytes = table[mine], [], [], []
    for state in shape.states:
        conv = state.kind == "conv"
        shift = table[:, COLUMN.bias] * (state.token_bytes if conv else 0)
        block = table[:, COLUMN.conv_src if conv else COLUMN.temporal_src]
        src.append(state.offset + block * state.block_stride + shift)
        dst.append(state.offset + table[:, COLUMN.dst] * state.block_stride)
        nbytes.append(np.maximum(state.block_bytes - shift, 0))
    src, dst, count = (np.stack(x) // shape.row_bytes for x in (src, dst, nbytes))
    group = np.broadcast_to(table[:, COLUMN.group], src.shape)
    order = np.argsort(group.ravel(), kind="stable")
    return Ranges(*(x.ravel()[order] for x in (src, dst, count, group)))


def _direct(rows: Ranges, shape: Shape, unit: int) -> tuple[Ranges, Ranges]:
    """Element ranges to copy directly, and to stage first (overlaps)."""
    src, dst, length = (x * (shape.row_bytes // unit) for x in rows[:3])
    keep = src != dst  # a move onto itself changes nothing
    staged = keep & (np.abs(src - dst) < length)
    pick = [keep & ~staged, staged]  # lists: read once a family and call
    return tuple(Ranges(*(x[m].tolist() for x in (src, dst, length, rows.group))) for m in pick)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The rows of each range, range after range."""
    firsts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + np.arange(lengths.sum()) - firsts


def _row_index(rows: Ranges, shape: Shape, device) -> RowIndex:
    """Source and destination rows of every layer of a family."""
    one_layer = np.stack([_ranges(rows.src, rows.length), _ranges(rows.dst, rows.length)])
    index = torch.from_numpy(one_layer).to(device, non_blocking=True)
    # all layers: layer 0's rows moved by the layer stride, on the device
    step = shape.layer_rows or 1
    firsts = torch.arange(0, shape.layers * step, step, device=device)
    index = (index[:, None] + firsts[:, None]).view(2, -1)
    sizes = [rows.length[rows.group == g].sum() for g in shape.groups]
    ends = np.cumsum([0, *sizes]).tolist()
    groups = {g: (ends[i], ends[i + 1]) for i, g in enumerate(shape.groups)}
    return RowIndex(index, ends[-1], groups)


def _is_small_step(ranges: int, families: int) -> bool:
    """At most DIRECT_PAIRS_PER_FAMILY ranges per family, plus twice
    that per step."""
    return ranges <= DIRECT_PAIRS_PER_FAMILY * (families + 2)


def _plan(moves: list[Move], copies: GroupedCopies) -> Plan:
    """Pick the step's strategy (see the module docstring)."""
    table = np.array(moves, dtype=np.int64)
    blocks, num_blocks = table[:, BLOCKS], copies.num_blocks
    if blocks.min() < 0 or blocks.max() >= num_blocks:
        used = np.unique(blocks).tolist()
        raise IndexError(f"Mamba state copy outside the {num_blocks} KV-cache blocks: {used}")
    bad = _interacting(blocks)
    serial = [m for m, interacts in zip(moves, bad) if interacts]
    plan, families = Plan(moves, serial, set(copies.places)), copies.families
    shapes = dict.fromkeys(f.shape for f in families)
    rows = {s: _rows(table[~bad], s) for s in shapes}
    data = families[0].by_row  # the gather buffer's element type
    unit = data.element_size()
    if _is_small_step(sum(len(rows[f.shape].src) for f in families), len(families)):
        plan.direct = {s: _direct(r, s, unit) for s, r in rows.items()}
        staged = [sum(plan.direct[f.shape][1].length) * f.shape.layers for f in families]
        if sum(staged) * unit <= GATHER_BYTES:
            return plan
        plan.direct = None  # staging over the cap: indexed after all
    plan.indexed = {s: _row_index(r, s, data.device) for s, r in rows.items()}
    # the indices count in the cap: the buffer takes what they leave,
    # or half the cap when they leave less (the docstring's exception)
    counted = [(s.layers + 1) * i.per_layer for s, i in plan.indexed.items()]
    budget = max(GATHER_BYTES - INDEX_BYTES * sum(counted), GATHER_BYTES // 2)
    sizes = []
    for shape, index in plan.indexed.items():
        fit = min(shape.layers * index.per_layer, budget // shape.row_bytes)
        sizes.append(max(1, fit) * shape.row_bytes)  # rows, one at least
    elements = max(sizes) // unit
    plan.buffer = torch.empty(elements, dtype=data.dtype, device=data.device)
    return plan


def _copy_direct(plan: Plan, targets: list[Place]) -> None:
    """One multi-tensor copy of views over the targets' layers."""
    views = [([], []), ([], [])]  # (sources, destinations): unstaged, staged
    for family, layer, group in targets:
        data = family.by_layer if layer is None else family.by_layer[layer : layer + 1]
        for (srcs, dsts), ranges in zip(views, plan.direct[family.shape]):
            for src, dst, n, g in zip(*ranges):
                if group in (None, g):
                    srcs.append(data[:, src : src + n])
                    dsts.append(data[:, dst : dst + n])
    (srcs, dsts), (staged_srcs, staged_dsts) = views
    if staged_srcs:  # read shifted sources whole before the copy writes
        sizes = [s.numel() for s in staged_srcs]
        first = staged_srcs[0]
        scratch = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
        scratch = [t.view(s.shape) for t, s in zip(scratch.split(sizes), staged_srcs)]
        torch._foreach_copy_(scratch, staged_srcs)
        srcs, dsts = srcs + scratch, dsts + staged_dsts
    if srcs:
        torch._foreach_copy_(dsts, srcs)


def _chunks(buffer: torch.Tensor, index: torch.Tensor, width: int):
    """(source rows, destination rows, buffer view) of each chunk,
    made as they are copied: the first copy starts at once. A new
    generator for each target: a used one is empty."""
    step = max(1, buffer.numel() // width)
    full = buffer[: step * width].view(step, width)
    for first in range(0, index.shape[1], step):
        src, dst = index[:, first : first + step]
        yield src, dst, full[: len(src)]


def _copy_indexed(plan: Plan, targets: list[Place]) -> None:
    """Gather the targets' rows into the buffer and scatter them."""
    for family, layer, group in targets:
        rows, data = plan.indexed[family.shape], family.by_row
        index = rows.index
        if layer is not None:  # one layer's rows of one group
            first, end = (layer * rows.per_layer + i for i in rows.groups[group])
            index = index[:, first:end]
        for src, dst, out in _chunks(plan.buffer, index, data.shape[1]):
            torch.index_select(data, 0, src, out=out)
            data.index_copy_(0, dst, out)


def _copy_pair_by_pair(layers: list[Layer], moves: list, layer_name) -> None:
    """``dst.copy_(src.clone())`` in pair order: move, layer, state."""
    for move in moves:
        for layer in layers:
            if layer.group != move.group or layer_name not in (None, layer.name):
                continue
            for state, func in zip(layer.states, layer.funcs):  # as vLLM's specs read
                if _kind(func, state) == "conv":
                    src = state[move.conv_src, move.bias :].flatten()
                else:
                    src = state[move.temporal_src].flatten()
                state[move.dst].view(-1)[: len(src)].copy_(src.clone())


def copy(copy_bufs, layer_name: str | None = None) -> bool:
    """Copy the step (and forget it) or one layer; False: no moves."""
    moves = getattr(copy_bufs, "_mamba_copy_requests", None)
    if not moves:
        return False
    copies = copy_bufs._mamba_copy_groups
    if copies.plan is None or copies.plan.moves is not moves:
        copies.plan = _plan(moves, copies)  # once a step
    plan, every = copies.plan, [Place(f, None, None) for f in copies.families]
    targets = every if layer_name is None else copies.places.get(layer_name, [])
    (_copy_indexed if plan.direct is None else _copy_direct)(plan, targets)
    _copy_pair_by_pair(copies.layers, plan.serial, layer_name)
    plan.pending.discard(layer_name)
    if layer_name is None or not plan.pending:
        copies.plan = None  # the step is done: its temporaries go
        copy_bufs._mamba_copy_requests = []
    return True
