"""One row's tokens written into, or read back from, the host store's pages through its block
table, one Triton launch per chunk and plane (design §6): for pages scattered over the pool,
where one DMA per head and run of consecutive pages would be thousands of tiny copies (a
prefill chunk; a chunked prefill's read-back of the earlier chunks). Reads and writes pinned
host memory through UVA on CUDA. Grid ``(blocks, H_kv)``; a block whose page is not in the
chunk is left to the chunk that holds it. Twins: the per-run copies of
:meth:`sparda.cache.host.HostKVStore.put_tokens` and ``get_tokens``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparda.errors import SpardaError
from sparda.kernels._common import next_pow2


@triton.jit
def _pages_kernel(SK, SV, PK, PV, TABLE, row, start, end, first, page0, page1,
                  s_head, s_tok, d_head, d_page, t_row,
                  X: tl.constexpr, X_P: tl.constexpr, BS: tl.constexpr, BS_P: tl.constexpr, READ: tl.constexpr):
    """Tokens ``start .. end - 1`` of ``row``: ``S [H, T, X]`` (token ``t`` at ``t - start``)
    into the pages ``P``, or (``READ``) the pages into ``S``."""
    n = (first + tl.program_id(0)).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    page = tl.load(TABLE + row * t_row + n).to(tl.int64)
    ok = (page >= page0) & (page < page1)
    offs_t = tl.arange(0, BS_P)
    offs_x = tl.arange(0, X_P)
    tok = n * BS + offs_t
    m = ((offs_t < BS) & (tok >= start) & (tok < end) & ok)[:, None] & (offs_x < X)[None, :]
    src = h * s_head + (tok - start)[:, None] * s_tok + offs_x[None, :]
    dst = h * d_head + tl.maximum(page - page0, 0) * d_page + offs_t[:, None] * X + offs_x[None, :]
    if READ:
        tl.store(SK + src, tl.load(PK + dst, mask=m), mask=m)
        tl.store(SV + src, tl.load(PV + dst, mask=m), mask=m)
    else:
        tl.store(PK + dst, tl.load(SK + src, mask=m), mask=m)
        tl.store(PV + dst, tl.load(SV + src, mask=m), mask=m)


def write_pages(dst_k: torch.Tensor, dst_v: torch.Tensor, page0: int, table: torch.Tensor, row: int,
                src_k: torch.Tensor, src_v: torch.Tensor, start: int, read: bool = False) -> None:
    """``dst[h, table[row, n] - page0, t % bs] = src[h, t - start]`` for tokens ``t`` of
    ``start .. start + T - 1`` whose block ``n = t // bs`` has a page in ``[page0, page0 + P')``;
    ``read``: the other way, ``src[h, t - start] = dst[h, page, t % bs]``.

    Args:
        dst_k, dst_v: one chunk's plane ``[H, P', bs, x]`` (pinned host memory on CUDA).
        table: ``[B, N]`` int32 block table, on the device of ``src``.
        src_k, src_v: ``[H, T, x]``, the plane's dtype, last dim contiguous, same strides.
    Raises:
        SpardaError: mismatched shapes, dtypes or strides.
    """
    h, pages, bs, x = dst_k.shape
    t = src_k.shape[1]
    if (src_k.shape != (h, t, x) or src_v.shape != src_k.shape or dst_v.shape != dst_k.shape
            or src_k.dtype != dst_k.dtype or src_v.dtype != dst_k.dtype or dst_v.dtype != dst_k.dtype):
        raise SpardaError(f"write_pages: source {tuple(src_k.shape)} / {tuple(src_v.shape)} does not match "
                          f"pages {tuple(dst_k.shape)} / {tuple(dst_v.shape)} in shape or dtype")
    if (src_k.stride(-1) != 1 or src_v.stride() != src_k.stride() or not dst_k.is_contiguous()
            or not dst_v.is_contiguous()):
        raise SpardaError("write_pages: sources need a contiguous last dim and equal strides; pages contiguous")
    if t == 0:
        return
    first, last = start // bs, (start + t - 1) // bs
    _pages_kernel[(last - first + 1, h)](
        src_k, src_v, dst_k, dst_v, table, row, start, start + t, first, page0, page0 + pages,
        src_k.stride(0), src_k.stride(1), dst_k.stride(0), dst_k.stride(1), table.stride(0),
        X=x, X_P=next_pow2(max(x, 2)), BS=bs, BS_P=next_pow2(bs), READ=read, num_warps=4)
