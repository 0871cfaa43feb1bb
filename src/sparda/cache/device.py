"""The on-device KV cache: full K/V per layer plus compressed keys (design §3.1).

The cache stores and moves; it never chooses blocks. Rows are sequences; each row has
its own length, so a batch can mix prompt lengths.
"""

from __future__ import annotations

import torch

from sparda import kernels
from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.kernels import reference as ref


class DeviceKVCache:
    """Per-layer K/V ``[B, H_kv, capacity, d]`` and compressed keys ``[B, H_kv, C_cap, d]``.

    Compressed key ``j`` of a row is ``mean(K[j*s : j*s + k])`` over post-RoPE keys, kept
    up to date as tokens arrive (written in prefill, one window at a time in decode).

    Args:
        num_layers, batch, num_kv_heads, head_dim: shape.
        capacity: tokens per row.
        selection: kernel/stride of the compressed keys.
        dtype, device: storage.
    Raises:
        SpardaError: if the cache does not fit in memory (bytes needed are named).
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int,
                 capacity: int, selection: SelectionConfig, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.selection = selection
        self.capacity = capacity
        self.num_ck_capacity = ref.num_compressed(capacity, selection.kernel_size, selection.kernel_stride)
        shape = (batch, num_kv_heads, capacity, head_dim)
        ck_shape = (batch, num_kv_heads, max(self.num_ck_capacity, 1), head_dim)
        try:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.ck = [torch.zeros(ck_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        except (RuntimeError, MemoryError) as exc:
            need = 2 * num_layers * batch * num_kv_heads * capacity * head_dim * torch.finfo(dtype).bits // 8
            raise SpardaError(
                f"KV cache of {need / 2**30:.2f} GiB does not fit on {device}; use a smaller batch or context"
            ) from exc
        #: ``[B]`` int64 tokens stored per row.
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes held by K and V (compressed keys excluded)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def used_bytes(self) -> int:
        """Bytes of K and V actually filled, summed over rows and layers."""
        per_token = 2 * len(self.k) * self.k[0].shape[1] * self.k[0].shape[3] * self.k[0].element_size()
        return int(self.lengths.sum().item()) * per_token

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, step) -> None:
        """Write this step's keys/values and update compressed keys (design §3.1).

        Args:
            layer: layer index.
            k, v: ``[B, H_kv, Tq, d]`` post-RoPE, cast to the cache dtype on write, for rows
                ``step.rows`` at positions ``step.q_pos``. Prefill writes one row, positions
                ``step.max_kv_len - Tq .. step.max_kv_len - 1`` (a chunk; from 0 unless the
                prefill is chunked), and the compressed keys those tokens complete; decode
                writes one token per row (``Tq = 1``).
            step: the :class:`~sparda.model.llama.StepInfo` (``phase``, ``rows [B]``,
                ``q_pos [B, Tq]`` int64).
        No bounds checks: positions must be ``< capacity`` (torch raises IndexError otherwise).
        """
        cfg = self.selection
        if step.phase == "prefill":
            row = int(step.rows[0])
            end = step.max_kv_len
            start = end - k.shape[-2]
            self.k[layer][row, :, start:end] = k[0]
            self.v[layer][row, :, start:end] = v[0]
            j0, ck = kernels.completed_compressed_keys(self.k[layer][row], start, end, cfg.kernel_size,
                                                      cfg.kernel_stride)
            self.ck[layer][row, :, j0:j0 + ck.shape[-2]] = ck
            if layer == len(self.k) - 1:
                self.lengths[row] = end
            return
        rows = step.rows
        pos = step.q_pos[:, 0]
        self.k[layer][rows, :, pos] = k[:, :, 0]
        self.v[layer][rows, :, pos] = v[:, :, 0]
        ref.update_compressed_keys(self.ck[layer], self.k[layer], rows, pos, cfg.kernel_size, cfg.kernel_stride)
        if layer == len(self.k) - 1:
            self.lengths[rows] = pos + 1

    def rope_append(self, layer: int, qkv: torch.Tensor, step, group: int, num_f: int):
        """Fused decode append (design §6): RoPE of this step's queries, keys and ``num_f``
        Forecast heads from the stacked projection ``qkv [B, (H_q + (2 + num_f) H_kv) d]``,
        the K/V write at ``step.q_pos`` and the compressed-key update, in one kernel
        (:func:`sparda.kernels.rope_append`). Every cache row, in order.

        Returns ``(q [B, H_q, d], f [B, num_f, H_kv, d] or None)`` in the cache dtype.
        """
        cfg = self.selection
        bsz, heads, _, d = self.k[layer].shape
        q = qkv.new_empty(bsz, heads * group, d)
        f = qkv.new_empty(bsz, num_f, heads, d) if num_f else None
        kernels.rope_append(qkv, step.cos, step.sin, step.q_pos[:, 0], q, f, self.k[layer], self.v[layer],
                            self.ck[layer], num_kv_heads=heads, group=group, num_f=num_f,
                            block_size=cfg.block_size, kernel=cfg.kernel_size, stride=cfg.kernel_stride,
                            lengths=self.lengths if layer == len(self.k) - 1 else None)
        return q, f

    def num_compressed(self, num_tokens: int) -> int:
        """Compressed keys complete after ``num_tokens`` tokens."""
        return ref.num_compressed(num_tokens, self.selection.kernel_size, self.selection.kernel_stride)

    def view(self, layer: int, rows: torch.Tensor, num_tokens: int):
        """K, V ``[b, H, num_tokens, d]`` and compressed keys ``[b, H, C, d]`` of ``rows``.

        Args:
            layer: layer index. rows: ``[b]`` int64 cache rows (all rows: views, no copy).
            num_tokens: tokens to expose; ``C = num_compressed(num_tokens)``.
        Returns:
            ``(k, v, ck)`` in the cache dtype.
        Raises:
            SpardaError: ``num_tokens`` exceeds the capacity.
        """
        if num_tokens > self.capacity:
            raise SpardaError(f"{num_tokens} tokens exceed the cache capacity {self.capacity}")
        num_ck = self.num_compressed(num_tokens)
        if rows.numel() == self.k[layer].shape[0]:
            return (self.k[layer][:, :, :num_tokens], self.v[layer][:, :, :num_tokens],
                    self.ck[layer][:, :, :num_ck])
        return (self.k[layer][rows, :, :num_tokens], self.v[layer][rows, :, :num_tokens],
                self.ck[layer][rows, :, :num_ck])
