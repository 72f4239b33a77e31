"""Packed documents that stay apart: block-diagonal attention and per-document positions.

The mask contract. ``attention_mask`` (B, S) is 0 on padding and positive on tokens; a row may number
its documents 1, 2, 3, ... (the loader's ``packing="document"``), and a *document* is a run of equal
positive values. An all-ones row is one document, so a plain 0/1 mask means what it always meant. A
row packed by the loader reads::

    [CLS] d1 ... [SEP] d2 ... [SEP] ... dn ... [SEP] [PAD] ...
    1     1  ... 1     2  ... 2     ... n  ... n     0

The row's [CLS] belongs to its first document, each document's [SEP] to that document, and an
[SEP] the loader adds after a document cut at the row's end to the cut document.

:func:`row_layout` turns a mask into what the layers take:

``None``
    every row is one document from position 0 with no padding: no mask at all, so SDPA may choose
    its fastest kernel;
a bool (B, 1, 1, S) key-padding mask
    every row holds at most one document, starting at position 0 (nothing to separate);
a :class:`DocumentPlan`
    some row holds several documents, and blocks pay. The documents of the whole micro-batch are
    sorted by length and cut into *blocks* of similar length (the longest of a block at most
    :data:`BLOCK_RATIO` times its shortest): a block is a dense (n, L) batch of n documents padded
    to its longest L, so each block is one ordinary attention call (softmax through SDPA, or linear
    attention with its sums over the block's rows = per document), with a key-padding mask only
    when its lengths differ. A packed row of 30 documents of ~50 tokens then costs ~30 x 50^2
    scores instead of 1536^2. Results are written back to the row layout with one gather;
a bool (B, 1, S, S) block-diagonal mask
    some row holds several documents, but the blocks' work (sum n L^2) is above
    :data:`BLOCKS_BELOW` of the rows' (B S^2): few, long documents per row (short rows), where
    one call with a mask costs about what the rows cost and the blocks' extra calls would not
    pay. Linear attention never takes it (its sums must be per document).

Positions (``model.document_positions``): ``restart`` counts each document from 0, so a document
packed anywhere computes what it computes alone; ``continue`` keeps the row's positions. The plan
carries each block's rotary tables ((L, D/2) shared when restarting, (n, L, D/2) per document when
continuing); the dense form passes one table per row ((B, S, D/2)); :class:`Layout` carries the
(B, S) position ids for learned absolute positions.

The kernel (``model.document_attention``, :func:`kernel_for`). The blocks and the dense mask above are
what ``blocks`` does, the CPU's choice (measured in bench/packing.py). On CUDA softmax attention takes
one kernel call per layer over the whole micro-batch instead, without gathers into blocks:

``varlen``
    flash-attn's varlen kernel over the documents laid end to end (``cu_seqlens``), when flash-attn is
    installed (half precision); its CPU stand-in :func:`varlen_reference` (one SDPA call per document) is
    what the tests compare with;
``flex``
    torch's flex attention on the rows as they are, with a block-sparse mask (:class:`FlexMask`): the
    (128 x 128) tiles of the score matrix that no document crosses are skipped, those inside one
    document computed without a mask, only the tiles on a document boundary apply ``same document``
    per score. The tiles are classified on the host from the mask alone (:func:`flex_tiles`, in the
    loader's workers with the rest of the plan), so the step reads nothing back. Flex attention has no
    dropout: with ``attention_probs_dropout_prob > 0`` the same plan runs SDPA with the block-diagonal
    mask. torch 2.13 runs flex attention's forward on CPU but not its backward; :func:`flex_reference`
    (SDPA with the block-diagonal mask) stands in for it in the CPU tests of the backward.

``auto`` is ``varlen`` on CUDA when flash-attn is installed, else ``flex`` on CUDA, else ``blocks``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import types
import warnings
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

BLOCK_RATIO = 2.0
"""The longest document of a block is at most this many times its shortest (bench/packing.py)."""
BLOCKS_BELOW = 0.35
"""Blocks are used when their attention work (sum n L^2) is at most this fraction of the rows' (B S^2);
else one dense call with a block-diagonal mask, which costs about what the rows cost (bench/packing.py)."""
FLEX_BLOCK = 128
"""Side of a flex-attention tile (queries x keys): torch's default sparse block size, which its CUDA
kernels are tuned for."""


@dataclass
class Block:
    """n documents of similar length as one dense (n, L) attention batch."""
    shape: tuple[int, int]              # (n, L)
    key_mask: Optional[torch.Tensor]    # (n, 1, 1, L) bool, True = a token of the document; None: all length L
    keep: Optional[torch.Tensor]        # (k,) the slots that hold tokens, None when all do
    cos: Optional[torch.Tensor]         # (L, D/2) restart | (n, L, D/2) continue | None (no rotary)
    sin: Optional[torch.Tensor]


@dataclass
class Varlen:
    """The same documents laid end to end (in the blocks' order), for a varlen kernel."""
    order: torch.Tensor                 # (T,) flat token of each packed position
    cu_seqlens: torch.Tensor            # (num_docs + 1,) int32 document starts, then T
    max_len: int
    cos: Optional[torch.Tensor]         # (T, D/2) each token's table row, None without rotary
    sin: Optional[torch.Tensor]


@dataclass
class DocumentPlan:
    """How one micro-batch's documents are attended (see the module docstring)."""
    blocks: list[Block]
    slots: torch.Tensor                 # (sum n * L,) flat (B * S) token of every block slot, block after block
                                        # (one gather for all blocks; a padding slot repeats a token)
    inverse: torch.Tensor               # (B * S,) row of the blocks' concatenated outputs; padding -> the zero row
    lengths: np.ndarray                 # every document's length (host), in block order
    varlen: Optional[Varlen] = None


@dataclass
class FlexMask:
    """The rows' documents for flex attention: ``block_mask`` (torch's ``BlockMask``, tiles from
    :func:`flex_tiles`) and ``doc`` (B, S), each token's document (0 = padding), which the boundary
    tiles read per score."""
    block_mask: object
    doc: torch.Tensor

    def dense(self) -> torch.Tensor:
        """The same mask as a bool (B, 1, S, S), True = attend: for SDPA (dropout, the CPU stand-in)."""
        return self.doc[:, None, :, None] == self.doc[:, None, None, :]


RowMask = Union[None, torch.Tensor, DocumentPlan, FlexMask]
"""What the layers take as ``attn_mask``: nothing, a bool key-padding or block-diagonal mask, a plan of
blocks, or a flex mask."""


def segments(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat (row-major) start and length of every document of a (B, S) mask (runs of equal positive values)."""
    B, S = mask.shape
    flat = mask.reshape(-1)
    change = np.ones(flat.shape[0], bool)
    change[1:] = flat[1:] != flat[:-1]
    change[::S] = True
    starts = np.flatnonzero(change)
    lengths = np.diff(np.append(starts, flat.shape[0]))
    tokens = flat[starts] > 0
    return starts[tokens], lengths[tokens]


def group_by_length(lengths: np.ndarray, ratio: Optional[float] = None) -> list[np.ndarray]:
    """Document indices per block: longest first, a block's longest at most ``ratio`` (default
    :data:`BLOCK_RATIO`) x its shortest."""
    ratio = BLOCK_RATIO if ratio is None else ratio
    order = np.argsort(-lengths, kind="stable")
    groups, i = [], 0
    while i < len(order):
        longest = lengths[order[i]]
        j = i + int(np.searchsorted(-lengths[order[i:]], -longest / ratio, side="right"))
        groups.append(order[i:j])
        i = j
    return groups


class Layout(NamedTuple):
    """What every layer takes besides the hidden states, and the embeddings' position rows."""
    mask: RowMask                         # the layers' attn_mask
    cos: Optional[torch.Tensor]           # rotary tables: (S, D/2), or (B, S, D/2) per row; None without rotary
    sin: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]  # (B, S) rows of learned absolute positions; None = 0..S-1


# --------------------------------------------------------------------------- the host's part


@dataclass
class HostBlock:
    """A block of :class:`RowPlan`: its shape and index tensors, no rotary tables yet."""
    shape: tuple[int, int]              # (n, L)
    key_mask: Optional[torch.Tensor]    # (n, 1, 1, L) bool; None: all documents of length L
    keep: Optional[torch.Tensor]        # (k,) slots that hold tokens; None when all do
    rows: Optional[torch.Tensor]        # (n * L,) each slot's row position (continue); None when restarting


@dataclass
class HostVarlen:
    """:class:`Varlen` without its rotary tables."""
    order: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    rows: torch.Tensor                  # (T,) each packed token's position


@dataclass
class RowPlan:
    """Everything :func:`row_layout` decides about a (B, S) mask, computed on the host from the mask alone:
    plain CPU tensors and ints, so that the loader's workers compute it beside the batch
    (``data_pipeline.loader.ShardLoader(prepare=...)``), the DataLoader pins it with the batch and one
    :meth:`to` puts it on the device. The model then builds its :class:`Layout` (:func:`device_layout`)
    without reading anything back from the device.

    ``form``: ``whole`` (no mask), ``padding`` (a key-padding mask from the mask itself), ``blocks``
    (a :class:`DocumentPlan`), ``dense`` (a block-diagonal mask from ``doc``) or ``flex`` (a
    :class:`FlexMask` from ``doc`` and ``tiles``)."""
    form: str
    restart: bool
    positions: Optional[torch.Tensor] = None   # (B, S) each token's position (blocks, dense)
    blocks: list = field(default_factory=list)  # HostBlock per block
    slots: Optional[torch.Tensor] = None
    inverse: Optional[torch.Tensor] = None
    lengths: Optional[np.ndarray] = None
    varlen: Optional[HostVarlen] = None
    doc: Optional[torch.Tensor] = None         # (B, S) each token's document over the batch, 0 = padding (dense, flex)
    tiles: Optional[tuple] = None              # flex_tiles(doc): four int32 tensors (flex)

    def _map(self, fn) -> "RowPlan":
        def t(x):
            return None if x is None else fn(x)
        return replace(self, positions=t(self.positions), slots=t(self.slots), inverse=t(self.inverse),
                       doc=t(self.doc), tiles=None if self.tiles is None else tuple(fn(x) for x in self.tiles),
                       blocks=[HostBlock(b.shape, t(b.key_mask), t(b.keep), t(b.rows)) for b in self.blocks],
                       varlen=None if self.varlen is None else replace(
                           self.varlen, order=fn(self.varlen.order), cu_seqlens=fn(self.varlen.cu_seqlens),
                           rows=fn(self.varlen.rows)))

    def to(self, device, non_blocking: bool = False) -> "RowPlan":
        """The same plan with its tensors on ``device`` (host -> device copies only)."""
        return self._map(lambda x: x.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "RowPlan":
        """Called by the DataLoader's pinning thread (``pin_memory=True``), as for the batch's tensors."""
        return self._map(lambda x: x.pin_memory())


def plan_rows(attention_mask, restart: bool, *, blocks_only: bool = False, kernel: str = "blocks") -> RowPlan:
    """The host's part of :func:`row_layout` for a (B, S) mask given on the host (a CPU tensor or an
    array). ``restart``: positions restart at each document; ``blocks_only`` / ``kernel``: as in
    :func:`row_layout`."""
    host = attention_mask.numpy() if isinstance(attention_mask, torch.Tensor) else np.asarray(attention_mask)
    B, S = host.shape
    starts, lengths = segments(host)
    if np.all(starts % S == 0) and np.bincount(starts // S, minlength=B).max(initial=0) <= 1:
        if len(starts) == B and np.all(lengths == S):
            return RowPlan("whole", restart)                             # whole rows: nothing to mask
        return RowPlan("padding", restart)                               # one document per row
    positions = _positions(starts, B, S, restart)
    rows = torch.from_numpy(positions).view(B, S)
    if kernel == "flex" and not blocks_only:
        doc = _document_numbers(host, starts)
        return RowPlan("flex", restart, positions=rows, doc=torch.from_numpy(doc),
                       tiles=tuple(torch.from_numpy(t) for t in flex_tiles(doc, FLEX_BLOCK)))
    groups = group_by_length(lengths)
    work = sum(len(g) * float(lengths[g[0]]) ** 2 for g in groups)
    if blocks_only or kernel == "varlen" or work <= BLOCKS_BELOW * B * S * S:
        return _plan(B, S, starts, lengths, groups, positions, restart, kernel == "varlen", rows)
    # few, long documents (short rows): one call with a block-diagonal mask costs about what the rows do
    return RowPlan("dense", restart, positions=rows, doc=torch.from_numpy(_document_numbers(host, starts)))


def _document_numbers(host: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """(B, S) each token's document, numbered over the batch from 1; padding 0 (it attends only to padding,
    so no row is empty)."""
    doc = np.zeros(host.size, np.int64)
    doc[starts] = 1
    doc = np.cumsum(doc)
    doc[host.reshape(-1) == 0] = 0
    return doc.reshape(host.shape)


def flex_tiles(doc: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Which (block x block) tiles of each row's score matrix flex attention computes, from (B, S) document
    numbers (any ints; a score is kept where query and key have the same one): ``kv_num_blocks`` (B, 1, n)
    and ``kv_indices`` (B, 1, n, n) of the *partial* tiles (some scores kept, some not: the mask is applied
    per score) and the same two of the *full* tiles (every score kept, no mask applied), n = ceil(S / block),
    in ``BlockMask.from_kv_blocks``'s layout (each row's indices ascending, the unused ones after them).
    A tile that reaches past S is never full. int32 arrays, as torch's ``create_block_mask`` makes them."""
    B, S = doc.shape
    n = -(-S // block)
    ids, inverse = np.unique(doc, return_inverse=True)
    present = np.zeros((B, n, len(ids)), np.float32)                  # tile t of row b holds document d
    rows = np.repeat(np.arange(B), S)
    present[rows, np.tile(np.arange(S) // block, B), inverse.reshape(-1)] = 1.0
    shared = present @ present.transpose(0, 2, 1) > 0                 # (B, n, n): a document in both tiles
    single = present.sum(-1) == 1                                     # one document fills the tile ...
    inside = np.arange(n) * block + block <= S                        # ... and the tile ends within S
    one = single & inside[None]
    full = shared & one[:, :, None] & one[:, None, :]
    partial = shared & ~full

    def ordered(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        counts = dense.sum(-1).astype(np.int32)[:, None]
        indices = np.argsort(~dense, axis=-1, kind="stable").astype(np.int32)[:, None]
        return counts, indices

    return (*ordered(partial), *ordered(full))


def _positions(starts: np.ndarray, B: int, S: int, restart: bool) -> np.ndarray:
    """(B * S,) each token's offset in its document (restart) or in its row (continue)."""
    total = B * S
    if not restart:
        return np.arange(total) % S
    is_start = np.zeros(total, bool)
    is_start[starts] = True
    is_start[::S] = True
    first = np.maximum.accumulate(np.where(is_start, np.arange(total), 0))
    return np.arange(total) - first


def _plan(B, S, starts, lengths, groups, positions, restart, varlen, rows) -> RowPlan:
    total = B * S
    blocks, slot_parts, order_parts, block_lengths = [], [], [], []
    for docs in groups:
        n, L = len(docs), int(lengths[docs[0]])
        offs = np.arange(L)
        valid = offs[None, :] < lengths[docs][:, None]                       # (n, L)
        slots = np.where(valid, starts[docs][:, None] + offs[None, :], starts[docs][:, None])
        flat_valid = valid.reshape(-1)
        uniform = bool(flat_valid.all())
        slot_parts.append(slots.reshape(-1))
        order_parts.append(slots.reshape(-1)[flat_valid])
        block_lengths.append(lengths[docs])
        blocks.append(HostBlock((n, L), None if uniform else torch.from_numpy(valid[:, None, None, :]),
                                None if uniform else torch.from_numpy(np.flatnonzero(flat_valid)),
                                None if restart else torch.from_numpy(positions[slots.reshape(-1)])))
    order = np.concatenate(order_parts)
    inverse = np.full(total, len(order), np.int64)
    inverse[order] = np.arange(len(order))
    plan = RowPlan("blocks", restart, positions=rows, blocks=blocks,
                   slots=torch.from_numpy(np.concatenate(slot_parts)), inverse=torch.from_numpy(inverse),
                   lengths=np.concatenate(block_lengths))
    if varlen:
        cu = np.zeros(len(plan.lengths) + 1, np.int32)
        np.cumsum(plan.lengths, out=cu[1:])
        plan.varlen = HostVarlen(torch.from_numpy(order), torch.from_numpy(cu), int(plan.lengths.max()),
                                 torch.from_numpy(positions[order]))
    return plan


# --------------------------------------------------------------------------- the device's part


def device_layout(plan: RowPlan, attention_mask: torch.Tensor, cos: Optional[torch.Tensor] = None,
                  sin: Optional[torch.Tensor] = None) -> Layout:
    """The layers' inputs from a :class:`RowPlan` already on the mask's device: index operations on the
    device only (no copy back to the host, no sync). ``cos``/``sin``: the (S, D/2) tables, or None."""
    if plan.form == "whole":
        return Layout(None, cos, sin, None)
    if plan.form == "padding":
        return Layout(attention_mask.bool()[:, None, None, :], cos, sin, None)
    B, S = plan.positions.shape
    if plan.form in ("dense", "flex"):
        if plan.form == "dense":
            mask = plan.doc[:, None, :, None] == plan.doc[:, None, None, :]     # (B, 1, S, S)
        else:
            mask = FlexMask(_block_mask(plan.tiles, plan.doc), plan.doc)
        if cos is not None and plan.restart:
            rows = plan.positions.reshape(-1)
            cos, sin = cos.index_select(0, rows).view(B, S, -1), sin.index_select(0, rows).view(B, S, -1)
        return Layout(mask, cos, sin, plan.positions)
    blocks = []
    for b in plan.blocks:
        n, L = b.shape
        bc = bs = None
        if cos is not None:
            if plan.restart:
                bc, bs = cos[:L], sin[:L]
            else:
                bc, bs = cos.index_select(0, b.rows).view(n, L, -1), sin.index_select(0, b.rows).view(n, L, -1)
        blocks.append(Block((n, L), b.key_mask, b.keep, bc, bs))
    out = DocumentPlan(blocks, plan.slots, plan.inverse, plan.lengths)
    if plan.varlen is not None:
        v = plan.varlen
        tc = ts = None
        if cos is not None:
            tc, ts = cos.index_select(0, v.rows), sin.index_select(0, v.rows)
        out.varlen = Varlen(v.order, v.cu_seqlens, v.max_len, tc, ts)
    return Layout(out, cos, sin, plan.positions)


def row_layout(attention_mask: Optional[torch.Tensor], restart: bool, cos: Optional[torch.Tensor] = None,
               sin: Optional[torch.Tensor] = None, *, blocks_only: bool = False, kernel: str = "blocks") -> Layout:
    """The layers' inputs for a (B, S) mask (see the module docstring). ``cos``/``sin``: the (S, D/2)
    rotary tables of the row, None without rotary. ``blocks_only``: never the dense block-diagonal mask
    nor a flex mask (linear attention needs per-document sums). ``kernel`` (:func:`kernel_for`): ``blocks``,
    ``varlen`` (also lay the documents out for a varlen kernel) or ``flex`` (a :class:`FlexMask`). Reads
    the mask on the host (one copy; a sync on a GPU): the training loop ships the :class:`RowPlan` from the
    loader instead (:func:`plan_rows`, :func:`device_layout`)."""
    if attention_mask is None:
        return Layout(None, cos, sin, None)
    plan = plan_rows(attention_mask.detach().cpu(), restart, blocks_only=blocks_only, kernel=kernel)
    return device_layout(plan.to(attention_mask.device), attention_mask, cos, sin)


# --------------------------------------------------------------------------- the kernels


@functools.cache
def flash_varlen_available() -> bool:
    """flash-attn's varlen kernel imports here. Installed is not enough: images often ship a flash-attn built
    for another torch, which fails at import (an undefined symbol); that is said once, and packed documents take
    flex attention instead. Cached: the import is tried once per process, never inside a compiled forward."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to load the build means: not usable here
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        log.warning("flash-attn is installed but does not load (%s: %s): packed documents use flex attention "
                    "instead of its varlen kernel (model.document_attention auto)", type(e).__name__, first[:200])
        return False
    return True


def flex_available() -> bool:
    """torch has flex attention (2.5 and later)."""
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def kernel_for(setting: str, kind: str, device) -> str:
    """``model.document_attention`` (``setting``) for ``kind`` attention on ``device``: ``blocks``, ``flex``
    or ``varlen`` (see the module docstring), among those the kind runs (``AttentionKind.document_kernels``:
    linear attention takes the blocks only)."""
    from roformer_dist.nn.attention_kinds import attention_kind

    runs = attention_kind(kind).document_kernels
    if setting != "auto":
        return setting if setting in runs else "blocks"
    if torch.device(device).type != "cuda":
        return "blocks"
    if flash_varlen_available() and "varlen" in runs:
        return "varlen"
    return "flex" if flex_available() and "flex" in runs else "blocks"


def _block_mask(tiles: tuple, doc: torch.Tensor):
    """torch's ``BlockMask`` of :func:`flex_tiles`' tiles (on ``doc``'s device), ``same document`` on the
    boundary tiles."""
    from torch.nn.attention.flex_attention import BlockMask

    def same_document(b, h, q, kv):
        return doc[b, q] == doc[b, kv]

    S = doc.shape[1]
    return BlockMask.from_kv_blocks(*tiles, BLOCK_SIZE=FLEX_BLOCK, mask_mod=same_document, seq_lengths=(S, S))


FLEX_COMPILED_ON = ("cuda",)
"""Device types on which flex attention runs compiled (its fused kernel). Elsewhere it runs eagerly: torch 2.13
on CPU runs the forward only, and a test adds "cpu" to count the compiles of the forward."""


class _FlexCompiles:
    """Flex attention compiled once per *shape family*: the q and k shapes, the dtype, the device and whether
    autograd records (a training step, or an evaluation's no-grad forward). A run sees a handful: each
    curriculum stage's micro-batch, each eval length, a last smaller batch of each. Each family compiles with
    static shapes (the fastest kernels) into a dynamo cache of its own (a fresh code object), so that no family
    counts against another's recompile limit, and the compile is logged once per family. The block mask is an
    input, not a constant: a new batch's documents do not recompile.

    Never silently eager: eager flex attention materialises the B x H x S x S scores. A family that fails to
    compile (a graph break is an error with ``fullgraph=True``) or hits dynamo's recompile limit logs one
    warning naming the family and the cause, and from then on runs :func:`flex_reference` (SDPA with the
    dense block-diagonal mask: the same result, the mask's S x S memory)."""

    def __init__(self):
        self.compiled: dict = {}
        """family -> its compiled function, or None when it runs the reference instead."""

    def reset(self) -> None:
        """Forget the compiled families (after ``torch._dynamo.reset()``, which drops their graphs): the next
        call of each compiles, and logs, again."""
        self.compiled.clear()

    @staticmethod
    def family(q: torch.Tensor, k: torch.Tensor) -> tuple:
        return (tuple(q.shape), tuple(k.shape), str(q.dtype).removeprefix("torch."), q.device.type,
                "training" if torch.is_grad_enabled() else "no grad")

    def __call__(self, q, k, v, mask: "FlexMask") -> torch.Tensor:
        from torch._dynamo.exc import FailOnRecompileLimitHit

        family = self.family(q, k)
        fn = self.compiled.get(family, ...)
        if fn is ...:
            fn = self.compiled[family] = torch.compile(_fresh_function(_flex_call), fullgraph=True, dynamic=False)
            log.info("flex attention: compiling for q %s, k %s, %s on %s, %s (shape family %d of this process)",
                     *family, len(self.compiled))
            first = True
        else:
            first = False
        if fn is None:
            return flex_reference(q, k, v, mask)
        try:
            return fn(q, k, v, mask.block_mask)
        except torch.OutOfMemoryError:
            raise
        except FailOnRecompileLimitHit as e:
            cause = f"dynamo's recompile limit was hit ({e})"
        except Exception as e:  # noqa: BLE001 - a compile that fails runs the reference, loudly
            if not first:
                raise
            cause = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        log.warning("flex attention: not compiled for q %s, k %s, %s on %s, %s: %s; this shape family runs SDPA "
                    "with the dense block-diagonal mask instead (the same result, slower and S x S memory); "
                    "model.document_attention=blocks avoids flex attention", *family, cause[:300])
        self.compiled[family] = None
        return flex_reference(q, k, v, mask)


def _flex_call(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask)


def _fresh_function(fn):
    """``fn`` with a code object of its own: dynamo keeps compiled graphs (and counts recompiles) per code
    object."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


flex_compiles = _FlexCompiles()
"""This process's compiled flex attention, by shape family."""


def _flex(q, k, v, mask: FlexMask):
    """torch's flex attention, (B, H, S, D) each -> (B, H, S, D). Compiled on CUDA once per shape family
    (:class:`_FlexCompiles`; eager flex attention computes the whole score matrix); on CPU eager, forward only
    (torch 2.13)."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():   # inside a compiled model: traced with it
        return flex_attention(q, k, v, block_mask=mask.block_mask)
    if q.device.type in FLEX_COMPILED_ON:
        return flex_compiles(q, k, v, mask)
    with warnings.catch_warnings():   # eager on purpose (its warning says to compile, for speed)
        warnings.filterwarnings("ignore", message=".*without torch.compile")
        return flex_attention(q, k, v, block_mask=mask.block_mask)


def flex_reference(q, k, v, mask: FlexMask):
    """What flex attention computes with ``mask``: SDPA with its block-diagonal mask (forward and backward)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense())


# Swappable (the tests' stand-in for the backward on CPU), as varlen_kernel is.
flex_kernel = _flex


def _flash_varlen(q, k, v, cu_seqlens, max_len, dropout_p):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, dropout_p=dropout_p,
                                  causal=False)


def varlen_reference(q, k, v, cu_seqlens, max_len, dropout_p):  # noqa: ARG001 - the kernel's signature
    """What flash-attn's varlen kernel computes, one SDPA call per document: (T, H, D) each -> (T, H, D)."""
    bounds = cu_seqlens.tolist()
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))   # (1, H, L, D)
        out.append(F.scaled_dot_product_attention(qi, ki, vi, dropout_p=dropout_p)[0].transpose(0, 1))
    return torch.cat(out)


# Swappable, as rotary.rotate_half_kernel is, so that the tests run the varlen path on CPU.
varlen_kernel = _flash_varlen


def varlen_applies(plan: DocumentPlan, qkv: torch.Tensor) -> bool:
    """The varlen layout is there and the kernel takes this dtype (flash-attn: fp16 / bf16 only, unless
    the reference stands in)."""
    return plan.varlen is not None and (varlen_kernel is not _flash_varlen
                                        or qkv.dtype in (torch.float16, torch.bfloat16))


__all__ = ["row_layout", "plan_rows", "device_layout", "RowPlan", "HostBlock", "HostVarlen", "Layout",
           "DocumentPlan", "Block", "Varlen", "RowMask", "segments", "group_by_length",
           "BLOCK_RATIO", "BLOCKS_BELOW", "varlen_reference", "varlen_applies",
           "flash_varlen_available", "flex_available", "kernel_for", "flex_tiles", "FlexMask", "flex_reference",
           "FLEX_BLOCK"]
