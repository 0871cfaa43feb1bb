"""Host <-> device transfer engines of the offload runtime (design §6), behind one interface.

Two operations, both on one :class:`~sparda.cache.host.HostChunk` (pages
``[page0, page1)`` of one layer's pool, with the block table ``table [B, N]`` mapping a
row's logical block to its page):

* :meth:`TransferEngine.gather`: ``dst[b, h, s] = host[h, table[b, load[b, h, s]]]`` for
  every slot with ``load >= 0`` (K and V), i.e. copy the missed blocks into their slots;
* :meth:`TransferEngine.store_tokens`: write one decoded token per row back to host
  memory at its position (keeps the host copy complete, block by block).

A block without a page (``-1``: a row the allocator has not given pages, decode padding) is
never written and gathers as zeros, so it cannot touch another row's pages.

Engines:

* ``uva``: Triton kernels that read (and write) pinned host memory directly through
  unified virtual addressing. A small fixed grid (``num_ctas`` CTAs x ``num_warps``
  warps; 32 x 8 by default, each moving a whole block per masked load: measured inside
  the replayed B16 step on the H200, design §6)
  grid-strides over the ``B*H*S`` block tasks; tasks whose ``load`` is ``-1`` (hits, free slots) move no bytes. No host
  synchronisation: the block ids never leave the device.
* ``copy``: the miss list is read on the host (one synchronisation), the blocks are
  gathered by the CPU into a pinned staging buffer and sent with one
  ``cudaMemcpyAsync`` (a contiguous run), then scattered into the slots on the GPU.
* ``sync``: plain PyTorch indexing (CPU runs and CI; synchronises on CUDA).
"""

from __future__ import annotations

import torch

from sparda.errors import SpardaError
from sparda.kernels._common import next_pow2

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False

ENGINES = ("uva", "copy", "sync")

if HAS_TRITON:
    @triton.jit
    def _copy_block(SK, SV, DK, DV, src, dst, ok, ELEMS: tl.constexpr, TILE: tl.constexpr):
        """Copy ``ELEMS`` contiguous elements of K and of V from offset ``src`` to ``dst``
        (zeros where ``ok`` is false: an unassigned page)."""
        offs = tl.arange(0, TILE)
        for i in range(0, ELEMS, TILE):
            m = (i + offs) < ELEMS
            tl.store(DK + dst + i + offs, tl.load(SK + src + i + offs, mask=m & ok, other=0), mask=m)
            tl.store(DV + dst + i + offs, tl.load(SV + src + i + offs, mask=m & ok, other=0), mask=m)

    @triton.jit
    def _uva_gather_kernel(SK, SV, DK, DV, SK2, SV2, DK2, DV2, LOAD, TABLE, num_tasks, S, H,
                           page0, page1,
                           s_head, s_page, d_row, d_head, d_slot,
                           s2_head, s2_page, d2_row, d2_head, d2_slot, l_row, l_head, t_row,
                           ELEMS: tl.constexpr, TILE: tl.constexpr, ELEMS2: tl.constexpr,
                           TILE2: tl.constexpr, TWO: tl.constexpr, TASKS: tl.constexpr, ZERO: tl.constexpr):
        """Block tasks ``t = (b*H + h)*S + s``, program ``p`` taking ``t = p (mod grid)``:
        ``TASKS`` of them at a time read their load entries and those blocks' pages (the
        block table) as vectors, then only the misses whose page is in this chunk are copied
        (rank by prefix sum), one block of K and V each, and with ``TWO`` the same block of
        the second plane (a quantised cache's scales) in the same task. With ``ZERO`` (the
        chunk holding page 0) a miss whose block has no page gets zeros."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs_q = tl.arange(0, TASKS)
        for c0 in range(0, num_tasks, nprog * TASKS):
            t = c0 + pid + offs_q * nprog
            t_ok = t < num_tasks
            bh = t // S
            blks = tl.load(LOAD + (bh // H) * l_row + (bh % H) * l_head + t % S, mask=t_ok, other=-1)
            want = blks >= 0
            pages = tl.load(TABLE + (bh // H).to(tl.int64) * t_row + blks, mask=want, other=-1)
            mine = (pages >= page0) & (pages < page1)
            if ZERO:
                mine = mine | (pages < 0)
            miss = (want & mine).to(tl.int32)
            rank = tl.cumsum(miss, 0)
            for j in range(0, tl.sum(miss, 0)):
                pick = (miss > 0) & (rank == j + 1)
                tj = tl.sum(tl.where(pick, t, 0), 0).to(tl.int64)
                pg = tl.sum(tl.where(pick, pages, 0), 0).to(tl.int64)
                ok = pg >= 0
                local = tl.maximum(pg - page0, 0)
                s = tj % S
                b = tj // S // H
                h = tj // S % H
                _copy_block(SK, SV, DK, DV, h * s_head + local * s_page,
                            b * d_row + h * d_head + s * d_slot, ok, ELEMS, TILE)
                if TWO:
                    _copy_block(SK2, SV2, DK2, DV2, h * s2_head + local * s2_page,
                                b * d2_row + h * d2_head + s * d2_slot, ok, ELEMS2, TILE2)

    @triton.jit
    def _uva_store_kernel(SK, SV, DK, DV, POS, TABLE, H, page0, page1, s_row, s_head, d_head, d_page, t_row,
                          D: tl.constexpr, D_P: tl.constexpr, BS: tl.constexpr):
        """One program per (row, head): write the token at ``POS[row]`` into its block's page
        (the block table), if that page is in this chunk (an unassigned block: no write)."""
        pid = tl.program_id(0)
        b = (pid // H).to(tl.int64)
        h = (pid % H).to(tl.int64)
        pos = tl.load(POS + b).to(tl.int64)
        page = tl.load(TABLE + b * t_row + pos // BS).to(tl.int64)
        ok = (page >= page0) & (page < page1)
        o = pos % BS
        offs = tl.arange(0, D_P)
        m = (offs < D) & ok
        dst = h * d_head + tl.maximum(page - page0, 0) * d_page + o * D + offs
        tl.store(DK + dst, tl.load(SK + b * s_row + h * s_head + offs, mask=m), mask=m)
        tl.store(DV + dst, tl.load(SV + b * s_row + h * s_head + offs, mask=m), mask=m)


class TransferEngine:
    """Interface of the engines. ``name`` is one of :data:`ENGINES`.

    Every engine follows the chunk's block table: a block without a page is never written
    to host memory and gathers as zeros (a row without pages is decode padding).
    """

    name = "base"
    #: whether a call synchronises the host with the device (documentation and stats)
    syncs_host = True

    def gather(self, chunk, dst_k: torch.Tensor, dst_v: torch.Tensor, load: torch.Tensor) -> None:
        """Copy missed blocks into slots: ``dst[b, h, s] = host[h, table[b, load[b, h, s]]]``.

        Args:
            chunk: :class:`~sparda.cache.host.HostChunk`, ``k, v [H, P', bs, d]`` (pages
                ``page0 .. page1 - 1``) and its ``table [B, N]`` int32.
            dst_k, dst_v: device slot buffers ``[B, H, S', bs, d]`` (``S' >= S``),
                contiguous, the chunk's dtype.
            load: ``[B, H, S]`` int64 on the device: block id to load into slot ``s``,
                ``-1`` for none. Only blocks whose page is in the chunk are copied; the
                chunk holding page 0 writes zeros for a block without a page.
        """
        raise NotImplementedError

    def gather_planes(self, chunk, planes: list[tuple[torch.Tensor, torch.Tensor]], load: torch.Tensor) -> None:
        """:meth:`gather` for every stored plane of ``chunk`` (:meth:`HostChunk.planes`: the
        data, and a quantised cache's scales) into ``planes`` (the slot buffers, one ``(K, V)``
        pair per plane, as ``OffloadKVCache._slot_planes``). This default gathers plane by
        plane; :class:`UvaEngine` moves both planes of a block in one task of one launch."""
        for part, (dst_k, dst_v) in zip(chunk.planes(), planes):
            self.gather(part, dst_k, dst_v, load)

    def store_tokens(self, chunk, k_tok: torch.Tensor, v_tok: torch.Tensor, pos: torch.Tensor) -> None:
        """``host[h, table[b, pos[b] // bs], pos[b] % bs] = k_tok[b, h]`` (and V) for the rows
        whose page is in the chunk.

        Args: ``k_tok, v_tok [B, H, d]`` device tensors; ``pos [B]`` int64 token positions.
        """
        raise NotImplementedError


def _pages(chunk, load: torch.Tensor):
    """``(b, h, s, page)`` of the slots of ``load [B, H, S]`` that get a block (on the chunk's
    device; ``page`` -1 for a block without one)."""
    part = load.to(chunk.k.device)
    b, h, s = (part >= 0).nonzero(as_tuple=True)
    table = chunk.table.to(chunk.k.device)
    return b, h, s, table[b, part[b, h, s]].long()


class SyncEngine(TransferEngine):
    """Plain PyTorch indexing; on CUDA it synchronises (reads the miss list on the host)."""

    name = "sync"

    def gather(self, chunk, dst_k, dst_v, load):
        """As :meth:`TransferEngine.gather` (``load [B, H, S]`` int64, slots
        ``[B, H, S', bs, d]``) by advanced indexing through the table; reads ``load`` on
        the host (syncs)."""
        b, h, s, page = _pages(chunk, load)
        if b.numel() == 0:
            return
        dev = dst_k.device
        mine = (page >= chunk.page0) & (page < chunk.page1)
        sel = mine.nonzero(as_tuple=True)[0]
        if sel.numel():
            bd, hd, sd = b[sel].to(dev), h[sel].to(dev), s[sel].to(dev)
            local = page[sel] - chunk.page0
            dst_k[bd, hd, sd] = chunk.k[h[sel], local].to(dev)
            dst_v[bd, hd, sd] = chunk.v[h[sel], local].to(dev)
        none = (page < 0).nonzero(as_tuple=True)[0]
        if chunk.page0 == 0 and none.numel():
            bd, hd, sd = b[none].to(dev), h[none].to(dev), s[none].to(dev)
            dst_k[bd, hd, sd] = 0
            dst_v[bd, hd, sd] = 0

    def store_tokens(self, chunk, k_tok, v_tok, pos):
        """As :meth:`TransferEngine.store_tokens` (``k_tok, v_tok [B, H, d]``, ``pos [B]``
        int64) by advanced indexing through the table; copies to the host (syncs on CUDA)."""
        hd = chunk.k.device
        p = pos.to(hd)
        bs = chunk.k.shape[2]
        table = chunk.table.to(hd)
        rows = torch.arange(p.numel(), device=hd)
        page = table[rows, (p // bs).clamp(max=table.shape[1] - 1)].long()
        sel = ((page >= chunk.page0) & (page < chunk.page1)).nonzero(as_tuple=True)[0]
        if sel.numel() == 0:
            return
        local, off = page[sel] - chunk.page0, p[sel] % bs
        # a slice then two advanced indices: the result dims are [H, R, d]
        chunk.k[:, local, off] = k_tok[sel.to(k_tok.device)].to(hd).transpose(0, 1)
        chunk.v[:, local, off] = v_tok[sel.to(v_tok.device)].to(hd).transpose(0, 1)


class CopyEngine(SyncEngine):
    """CPU gather into a pinned staging buffer, one async H2D copy, GPU scatter into slots.

    Synchronises once per call (the miss list and the table are read on the host). CUDA only.
    """

    name = "copy"

    def __init__(self) -> None:
        self._staging: torch.Tensor | None = None
        self._event = None

    def _stage(self, count: int, like: torch.Tensor) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()  # the previous H2D copy has read the staging buffer
        if self._staging is None or self._staging.shape[1] < count or self._staging.dtype != like.dtype:
            self._staging = torch.empty((2, max(count, 64), *like.shape[-2:]), dtype=like.dtype,
                                        pin_memory=True)
        return self._staging

    def gather(self, chunk, dst_k, dst_v, load):
        """As :meth:`TransferEngine.gather` (``load [B, H, S]`` int64, slots
        ``[B, H, S', bs, d]``): one host sync for the miss list, a CPU gather of the
        missed ``[bs, d]`` pages into pinned staging, one async H2D copy, a GPU scatter
        (zeros scattered directly for blocks without a page)."""
        b, h, s, page = _pages(chunk, load)
        dev = dst_k.device
        none = (page < 0).nonzero(as_tuple=True)[0]
        if chunk.page0 == 0 and none.numel():
            bd, hd, sd = b[none].to(dev), h[none].to(dev), s[none].to(dev)
            dst_k[bd, hd, sd] = 0
            dst_v[bd, hd, sd] = 0
        sel = ((page >= chunk.page0) & (page < chunk.page1)).nonzero(as_tuple=True)[0]
        n = sel.numel()
        if n == 0:
            return
        b, h, s = b[sel], h[sel], s[sel]
        flat = h * chunk.k.shape[1] + page[sel] - chunk.page0
        staging = self._stage(n, chunk.k)
        torch.index_select(chunk.k.view(-1, *chunk.k.shape[-2:]), 0, flat, out=staging[0, :n])
        torch.index_select(chunk.v.view(-1, *chunk.v.shape[-2:]), 0, flat, out=staging[1, :n])
        sent_k = staging[0, :n].to(dev, non_blocking=True)  # contiguous pinned runs: async DMA
        sent_v = staging[1, :n].to(dev, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        rd, hd, sd = b.to(dev), h.to(dev), s.to(dev)
        dst_k[rd, hd, sd] = sent_k
        dst_v[rd, hd, sd] = sent_v


class UvaEngine(TransferEngine):
    """Triton kernels reading/writing pinned host memory through UVA (no host sync).

    Args:
        num_ctas: CTAs of the gather grid (grid-stride over block tasks).
        num_warps: warps per CTA. tile: elements moved per masked load/store.
    Raises:
        SpardaError: Triton is missing, or ``num_ctas``/``num_warps < 1`` or ``tile`` not a
            power of two >= 16.
    """

    name = "uva"
    syncs_host = False

    def __init__(self, num_ctas: int = 32, num_warps: int = 8, tile: int = 8192) -> None:
        if not HAS_TRITON:
            raise SpardaError("the uva transfer engine needs Triton; use --transfer copy or sync")
        if num_ctas < 1 or num_warps < 1 or tile < 16 or tile & (tile - 1):
            raise SpardaError("uva engine: num_ctas, num_warps >= 1 and tile a power of two >= 16")
        self.num_ctas, self.num_warps, self.tile = num_ctas, num_warps, tile

    #: block tasks whose load entries one program reads as one vector before copying its misses
    TASKS = 64

    def gather(self, chunk, dst_k, dst_v, load):
        """As :meth:`TransferEngine.gather` (``load [B, H, S]`` int64, slots
        ``[B, H, S', bs, d]``), by the grid-stride UVA kernel; no host sync (design §6)."""
        self._launch(chunk, [(dst_k, dst_v)], load)

    def gather_planes(self, chunk, planes, load):
        """As :meth:`TransferEngine.gather_planes`, in one launch: a block's data and scales
        are one task (a quantised cache no longer walks the load list twice)."""
        parts = chunk.planes()
        if len(parts) > 2 or len(parts) != len(planes):
            return super().gather_planes(chunk, planes, load)
        self._launch(chunk, planes, load, parts)

    def _launch(self, chunk, planes, load, parts=None) -> None:
        parts = parts or [chunk]
        rows, heads, slots = load.shape
        if load.stride(-1) != 1:
            load = load.contiguous()
        table = chunk.table
        args, consts = [], []
        for i in range(2):
            c, (dk, dv) = (parts[i], planes[i]) if i < len(parts) else (parts[0], planes[0])
            elems = c.k.shape[2] * c.k.shape[3]
            args.append((c.k, c.v, dk, dv, (c.k.stride(0), c.k.stride(1)),
                         (dk.stride(0), dk.stride(1), dk.stride(2))))
            consts.append((elems, min(self.tile, next_pow2(elems))))
        tasks = rows * heads * slots
        grid = (max(1, min(self.num_ctas, tasks)),)
        (k1, v1, dk1, dv1, ss1, ds1), (k2, v2, dk2, dv2, ss2, ds2) = args
        _uva_gather_kernel[grid](
            k1, v1, dk1, dv1, k2, v2, dk2, dv2, load, table, tasks, slots, heads,
            chunk.page0, chunk.page1,
            *ss1, *ds1, *ss2, *ds2, load.stride(0), load.stride(1), table.stride(0),
            ELEMS=consts[0][0], TILE=consts[0][1], ELEMS2=consts[1][0], TILE2=consts[1][1],
            TWO=len(parts) == 2, TASKS=self.TASKS, ZERO=chunk.page0 == 0, num_warps=self.num_warps)

    def store_tokens(self, chunk, k_tok, v_tok, pos):
        """As :meth:`TransferEngine.store_tokens` (``k_tok, v_tok [B, H, d]``, ``pos [B]``
        int64), one Triton program per (row, head) writing host memory via UVA; no sync."""
        rows = k_tok.shape[0]
        heads, d = chunk.k.shape[0], chunk.k.shape[3]
        sk, sv = k_tok, v_tok
        if sk.stride(-1) != 1 or sv.stride() != sk.stride():
            sk, sv = sk.contiguous(), sv.contiguous()
        p = pos.contiguous()
        _uva_store_kernel[(rows * heads,)](
            sk, sv, chunk.k, chunk.v, p, chunk.table, heads, chunk.page0, chunk.page1,
            sk.stride(0), sk.stride(1), chunk.k.stride(0), chunk.k.stride(1), chunk.table.stride(0),
            D=d, D_P=next_pow2(max(d, 16)), BS=chunk.k.shape[2], num_warps=1)


#: (smallest batch, CTAs) of the UVA gather grid, largest batch first: measured inside the
#: replayed decode step of offloaded ``sparda`` on the H200 (MiniCPM-8B shape; 8 warps):
#: 64 CTAs beat 32 by 6-7 % at 128K B16 and 32K B24, 16 CTAs were slowest
#: (design §6). Below B16 the gather shares the SMs
#: with a lighter step and was not tuned: it keeps 32.
GATHER_CTAS = ((16, 64), (1, 32))


def gather_ctas(batch: int) -> int:
    """CTAs of the UVA gather grid for a cache of ``batch`` rows (:data:`GATHER_CTAS`)."""
    for smallest, ctas in GATHER_CTAS:
        if batch >= smallest:
            return ctas
    return GATHER_CTAS[-1][1]


def make_engine(name: str, device: torch.device, batch: int | None = None, **kwargs) -> TransferEngine:
    """Build a transfer engine. ``auto``: ``uva`` on CUDA with Triton, else ``sync``.

    ``batch`` (rows of the cache it serves) picks the ``uva`` gather grid
    (:func:`gather_ctas`) unless ``num_ctas`` is given; other engines ignore it.

    Raises:
        SpardaError: an unknown name, or ``uva``/``copy`` requested off CUDA.
    """
    if name == "auto":
        name = "uva" if device.type == "cuda" and HAS_TRITON else "sync"
    if name == "uva" and batch is not None and "num_ctas" not in kwargs:
        kwargs["num_ctas"] = gather_ctas(batch)
    if name not in ENGINES:
        raise SpardaError(f"unknown transfer engine {name!r}; choose one of auto, {', '.join(ENGINES)}")
    if name in ("uva", "copy") and device.type != "cuda":
        raise SpardaError(f"transfer engine {name!r} needs a CUDA device; use sync on {device}")
    if name == "uva":
        return UvaEngine(**kwargs)
    return CopyEngine() if name == "copy" else SyncEngine()
