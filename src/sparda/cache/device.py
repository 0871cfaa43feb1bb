"""The on-device KV cache: full K/V per layer plus compressed keys (design §3.1).

The cache stores and moves; it never chooses blocks. Rows are sequences; each row has
its own length, so a batch can mix prompt lengths.
"""

from __future__ import annotations

import torch

from sparda import kernels
from sparda.cache.base import KVCache
from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.kernels import quant
from sparda.kernels import reference as ref


def window_keys(ring: torch.Tensor, keys: torch.Tensor, start: int, end: int, kernel: int,
                stride: int) -> tuple[int, torch.Tensor]:
    """:func:`~sparda.kernels.reference.completed_compressed_keys` of a prefill chunk from
    full-precision keys only (a quantised cache, docs/kv_quant.md): the keys of tokens
    ``j0 * stride .. start - 1`` that the chunk's windows reach back to come from ``ring``
    (the row's last ``kernel`` keys, token ``p`` at ``p % kernel``), the rest from the chunk.

    Args:
        ring: ``[H, kernel, d]`` one row's ring (full precision, filled up to ``start``).
        keys: ``[H, end - start, d]`` the chunk's post-RoPE keys.
        start, end, kernel, stride: tokens.
    Returns:
        ``(j0, ck [H, C, d])`` in ``keys``' dtype.
    """
    j0 = ref.num_compressed(start, kernel, stride)
    lo = min(j0 * stride, start)
    before = ring[:, torch.arange(lo, start, device=ring.device) % kernel]
    return j0, ref.compress_keys(torch.cat([before.to(keys.dtype), keys], -2), kernel, stride)


def fill_ring(ring: torch.Tensor, keys: torch.Tensor, start: int, end: int, kernel: int) -> None:
    """Write a prefill chunk's last ``kernel`` keys (``keys [H, end - start, d]``, tokens
    ``start .. end - 1``) into one row's ring ``[H, kernel, d]`` (token ``p`` at ``p % kernel``)."""
    pos = torch.arange(max(start, end - kernel), end, device=ring.device)
    ring[:, pos % kernel] = keys[:, pos - start].to(ring.dtype)


class DeviceKVCache(KVCache):
    """Per-layer K/V ``[B, H_kv, capacity, d]`` and compressed keys ``[B, H_kv, C_cap, d]``.

    Compressed key ``j`` of a row is ``mean(K[j*s : j*s + k])`` over post-RoPE keys, kept
    up to date as tokens arrive (written in prefill, one window at a time in decode).

    Args:
        num_layers, batch, num_kv_heads, head_dim: shape.
        capacity: tokens per row.
        selection: kernel/stride of the compressed keys.
        dtype, device: storage (``dtype``: of the compressed keys and of what :meth:`view` returns).
        kv_dtype: ``bf16`` (K/V in ``dtype``) or ``int8``/``int4``: K/V quantised on append
            (:class:`~sparda.kernels.quant.QuantizedKV`, docs/kv_quant.md), dequantised by
            :meth:`view`; the compressed keys are computed from the unquantised keys (a ring
            ``[B, H, kernel, d]`` of the last ``kernel`` keys per row, in ``dtype``).
    Raises:
        SpardaError: if the cache does not fit in memory (bytes needed are named).
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int,
                 capacity: int, selection: SelectionConfig, dtype: torch.dtype,
                 device: torch.device | str, kv_dtype: str = "bf16") -> None:
        super().__init__(batch, capacity, device)
        self.selection = selection
        self.kv_dtype = kv_dtype  # checked by the config (``mixed``: offloaded caches only)
        self.dtype = dtype
        self.num_ck_capacity = ref.num_compressed(capacity, selection.kernel_size, selection.kernel_stride)
        shape = (batch, num_kv_heads, capacity, head_dim)
        ck_shape = (batch, num_kv_heads, max(self.num_ck_capacity, 1), head_dim)
        try:
            self.k = [quant.kv_zeros(shape, kv_dtype, dtype, device) for _ in range(num_layers)]
            self.v = [quant.kv_zeros(shape, kv_dtype, dtype, device) for _ in range(num_layers)]
            self.ck = [torch.zeros(ck_shape, dtype=dtype, device=device) for _ in range(num_layers)]
            #: quantised caches: per layer ``[B, H, kernel, d]`` the last ``kernel`` unquantised keys
            self.ring = None if not quant.is_quantized(kv_dtype) else [
                torch.zeros(batch, num_kv_heads, selection.kernel_size, head_dim, dtype=dtype, device=device)
                for _ in range(num_layers)]
        except (RuntimeError, MemoryError) as exc:
            need = 2 * num_layers * batch * num_kv_heads * capacity * quant.token_bytes(head_dim, kv_dtype, dtype)
            raise SpardaError(
                f"KV cache of {need / 2**30:.2f} GiB does not fit on {device}; use a smaller batch or context"
            ) from exc

    @property
    def nbytes(self) -> int:
        """Bytes held by K and V (compressed keys excluded; quantised data and scales)."""
        return sum(t.nbytes for t in self.k + self.v)

    def used_bytes(self) -> int:
        """Bytes of K and V actually filled, summed over rows and layers."""
        heads, d = self.k[0].shape[1], self.k[0].shape[3]
        per_token = 2 * len(self.k) * heads * quant.token_bytes(d, self.kv_dtype, self.dtype)
        return int(self.lengths.sum().item()) * per_token

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, step) -> None:
        """Write this step's keys/values and update compressed keys (design §3.1).

        Args:
            layer: layer index.
            k, v: ``[B, H_kv, Tq, d]`` post-RoPE, cast to the cache dtype on write, for rows
                ``step.rows`` at positions ``step.q_pos``. Prefill writes one row, positions
                ``step.max_kv_len - Tq .. step.max_kv_len - 1`` (a chunk; from 0 unless the
                prefill is chunked), and the compressed keys those tokens complete; a batched
                prefill (``step.row_lengths``) writes each row's real tokens from 0, as that
                row's prefill alone would; decode writes one token per row (``Tq = 1``).
            step: the :class:`~sparda.model.llama.StepInfo` (``phase``, ``rows [B]``,
                ``q_pos [B, Tq]`` int64).
        No bounds checks: positions must be ``< capacity`` (torch raises IndexError otherwise).
        """
        cfg = self.selection
        if step.phase == "prefill":  # a batched prefill: each row's real tokens only
            for i, row, start, end in step.prefill_spans(k.shape[-2]):
                self._append_prefill(layer, row, k[i, :, :end - start], v[i, :, :end - start], start, end)
            return
        rows = step.rows
        pos = step.q_pos[:, 0]
        self.k[layer][rows, :, pos] = k[:, :, 0]
        self.v[layer][rows, :, pos] = v[:, :, 0]
        if self.ring is not None:  # quantised: compressed keys from the ring of unquantised keys
            self.ring[layer][rows, :, pos % cfg.kernel_size] = k[:, :, 0].to(self.dtype)
            ref.update_compressed_keys(self.ck[layer], self.ring[layer], rows, pos, cfg.kernel_size,
                                       cfg.kernel_stride, ring=True)
        else:
            ref.update_compressed_keys(self.ck[layer], self.k[layer], rows, pos, cfg.kernel_size, cfg.kernel_stride)
        if layer == len(self.k) - 1:
            self.lengths[rows] = pos + 1

    def _append_prefill(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, start: int,
                        end: int) -> None:
        """Prefill append of one row: ``k, v [H_kv, end - start, d]`` at tokens ``start ..
        end - 1``, then the compressed keys they complete; the row's length is ``end``
        after the last layer."""
        cfg = self.selection
        self.k[layer][row, :, start:end] = k
        self.v[layer][row, :, start:end] = v
        if self.ring is not None:  # quantised: compressed keys from the unquantised keys
            j0, ck = window_keys(self.ring[layer][row], k, start, end, cfg.kernel_size, cfg.kernel_stride)
            fill_ring(self.ring[layer][row], k, start, end, cfg.kernel_size)
        else:
            j0, ck = kernels.completed_compressed_keys(self.k[layer][row], start, end, cfg.kernel_size,
                                                       cfg.kernel_stride)
        self.ck[layer][row, :, j0:j0 + ck.shape[-2]] = ck
        if layer == len(self.k) - 1:
            self.lengths[row] = end

    def rope_append(self, layer: int, qkv: torch.Tensor, step, group: int, num_f: int):
        """Fused decode append (design §6): RoPE of this step's queries, keys and ``num_f``
        Forecast heads from the stacked projection ``qkv [b, (H_q + (2 + num_f) H_kv) d]``,
        the K/V write at ``step.q_pos`` and the compressed-key update, in one kernel
        (:func:`sparda.kernels.rope_append`). A quantised cache gets the token's codes and
        scales, and its ring of full-precision keys feeds the compressed keys (as
        :meth:`append`). The cache's first ``b`` rows, in order (design §3.13).

        Returns ``(q [b, H_q, d], f [b, num_f, H_kv, d] or None)`` in the cache dtype.
        """
        cfg = self.selection
        b = qkv.shape[0]
        _, heads, _, d = self.k[layer].shape
        q = qkv.new_empty(b, heads * group, d)
        f = qkv.new_empty(b, num_f, heads, d) if num_f else None
        kernels.rope_append(qkv, step.cos, step.sin, step.q_pos[:, 0], q, f, self.k[layer][:b], self.v[layer][:b],
                            self.ck[layer][:b], num_kv_heads=heads, group=group, num_f=num_f,
                            block_size=cfg.block_size, kernel=cfg.kernel_size, stride=cfg.kernel_stride,
                            ring=None if self.ring is None else self.ring[layer][:b],
                            lengths=self.lengths[:b] if layer == len(self.k) - 1 else None)
        return q, f

    def num_compressed(self, num_tokens: int) -> int:
        """Compressed keys complete after ``num_tokens`` tokens."""
        return ref.num_compressed(num_tokens, self.selection.kernel_size, self.selection.kernel_stride)

    def view(self, layer: int, rows, num_tokens: int):
        """K, V ``[b, H, num_tokens, d]`` and compressed keys ``[b, H, C, d]`` of ``rows``.

        Args:
            layer: layer index. rows: ``[b]`` int64 cache rows (all rows, in order: views),
                or a slice (a decode step's first ``b`` rows, :attr:`StepInfo.cache_rows`: views).
            num_tokens: tokens to expose; ``C = num_compressed(num_tokens)``.
        Returns:
            ``(k, v, ck)`` in the cache dtype (a quantised cache: K/V dequantised, a copy).
        Raises:
            SpardaError: ``num_tokens`` exceeds the capacity.
        """
        if num_tokens > self.capacity:
            raise SpardaError(f"{num_tokens} tokens exceed the cache capacity {self.capacity}")
        num_ck = self.num_compressed(num_tokens)
        if not isinstance(rows, slice) and rows.numel() == self.k[layer].shape[0]:
            rows = slice(None)
        k, v = self.k[layer][rows, :, :num_tokens], self.v[layer][rows, :, :num_tokens]
        ck = self.ck[layer][rows, :, :num_ck]
        return quant.as_float(k, self.dtype), quant.as_float(v, self.dtype), ck
