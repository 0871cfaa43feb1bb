"""The offloaded KV cache (design §6): full K/V in host memory, selected blocks in GPU slots.

What lives where:

* host (pinned on CUDA), :class:`~sparda.cache.host.HostKVStore`: the full K and V of
  every offloaded layer, block-major; decoded tokens are written back as they arrive,
  so every block is complete on the host once its last token is decoded;
* device: the compressed keys of every layer ``[B, H, C_cap, d]``; the last
  ``kernel_size`` keys per row (a ring, to compute new compressed keys); per offloaded
  layer a slot buffer ``[B, H, S + 1, block_size, d]`` for K and V, whose first ``S``
  slots hold fetched blocks (block map ``slot_map [B, H, S]``) and whose last slot is
  the current (partial) block, written in place as tokens are decoded; resident layers
  (e.g. layer 0) keep their full K/V on the device.

``S = min(N_cap, max(budget_blocks, ceil(dense_len / block_size)))`` slots hold any
selection, the dense fallback included. The cache moves blocks; the attention method
chooses them (:meth:`OffloadKVCache.fetch` takes a block mask).
"""

from __future__ import annotations

import torch

from sparda.cache.host import DEFAULT_CHUNK_BYTES, HostKVStore
from sparda.cache.prefetch import Prefetcher, diff_slots
from sparda.cache.transfer import make_engine
from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.kernels import reference as ref


def num_slots(capacity: int, cfg: SelectionConfig) -> int:
    """Slots per offloaded layer and KV head: enough for any selection (design §3.4, §3.6)."""
    blocks = -(-capacity // cfg.block_size)
    return max(1, min(blocks, max(cfg.budget_blocks, -(-cfg.dense_len // cfg.block_size))))


class OffloadKVCache:
    """KV cache with host-resident K/V and a per-layer GPU block cache.

    Same ``append``/``view`` interface as :class:`~sparda.cache.device.DeviceKVCache`;
    ``view`` of an offloaded layer in decode copies the whole layer from the host (a
    slow path for methods that do not fetch). Offload-aware methods call
    :meth:`fetch` (diff + copy of the misses), :meth:`wait` and :meth:`attend`.

    Args:
        num_layers, batch, num_kv_heads, head_dim, capacity, selection, dtype, device:
            as DeviceKVCache.
        engine: transfer engine name (``auto``, ``uva``, ``copy``, ``sync``).
        resident_layers: layers kept whole on the device (not offloaded).
        chunk_bytes: largest host allocation.
        engine_options: passed to the engine (``num_ctas``, ``num_warps``, ``tile``).
        timing: measure copy and exposed-wait time (:class:`~sparda.cache.prefetch.Prefetcher`).
    Raises:
        SpardaError: host or device memory does not suffice (bytes named), bad engine.
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int,
                 capacity: int, selection: SelectionConfig, dtype: torch.dtype,
                 device: torch.device | str, engine: str = "auto", resident_layers=(),
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, engine_options: dict | None = None,
                 timing: bool = False) -> None:
        self.device = torch.device(device)
        self.selection = cfg = selection
        self.capacity = capacity
        self.num_layers = num_layers
        self.batch = batch
        self.block_size = cfg.block_size
        self.num_blocks = -(-capacity // cfg.block_size)
        self.num_ck_capacity = ref.num_compressed(capacity, cfg.kernel_size, cfg.kernel_stride)
        self.resident = frozenset(l for l in resident_layers if 0 <= l < num_layers)
        self.offloaded = tuple(l for l in range(num_layers) if l not in self.resident)
        self.slots = num_slots(capacity, cfg)
        self.engine = make_engine(engine, self.device, **(engine_options or {}))
        self.host = HostKVStore(self.offloaded, batch, num_kv_heads, head_dim, self.num_blocks,
                                cfg.block_size, dtype, pin=self.device.type == "cuda",
                                chunk_bytes=chunk_bytes)
        shape = (batch, num_kv_heads, self.slots + 1, cfg.block_size, head_dim)
        ck_shape = (batch, num_kv_heads, max(self.num_ck_capacity, 1), head_dim)
        full = (batch, num_kv_heads, capacity, head_dim)
        try:
            self.ck = [torch.zeros(ck_shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
            self.ring = [torch.zeros(batch, num_kv_heads, cfg.kernel_size, head_dim, dtype=dtype,
                                     device=self.device) for _ in range(num_layers)]
            self.k_slots, self.v_slots, self.slot_map, self.k_full, self.v_full = {}, {}, {}, {}, {}
            for layer in self.offloaded:
                self.k_slots[layer] = torch.zeros(shape, dtype=dtype, device=self.device)
                self.v_slots[layer] = torch.zeros(shape, dtype=dtype, device=self.device)
                self.slot_map[layer] = torch.full((batch, num_kv_heads, self.slots), -1, dtype=torch.long,
                                                  device=self.device)
            for layer in self.resident:
                self.k_full[layer] = torch.zeros(full, dtype=dtype, device=self.device)
                self.v_full[layer] = torch.zeros(full, dtype=dtype, device=self.device)
        except (RuntimeError, MemoryError) as exc:
            elem = torch.empty((), dtype=dtype).element_size()
            need = elem * (2 * len(self.offloaded) * batch * num_kv_heads * (self.slots + 1) * cfg.block_size
                           + 2 * len(self.resident) * batch * num_kv_heads * capacity) * head_dim
            raise SpardaError(f"offload slot buffers of {need / 2**30:.2f} GiB do not fit on {self.device}; "
                              "use a smaller batch, context or budget, or --no-offload") from exc
        self.prefetcher = Prefetcher(self.engine, self.device, num_layers, self.host.block_bytes,
                                     batch=batch, timing=timing)
        #: ``[B]`` int64 tokens stored per row.
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self._stash: tuple | None = None  # prefill: (layer, k, v) of the prompt being run
        self._selected: dict[int, torch.Tensor] = {}  # layer -> [B, H, S] slot is selected

    # ---------------------------------------------------------------- sizes
    @property
    def nbytes(self) -> int:
        """Bytes of K and V for the full capacity (host plus resident layers)."""
        res = sum(t.numel() * t.element_size() for t in list(self.k_full.values()) + list(self.v_full.values()))
        return self.host.nbytes + res

    @property
    def device_bytes(self) -> int:
        """Bytes of the GPU side: slot buffers, resident layers, compressed keys, rings."""
        tensors = (list(self.k_slots.values()) + list(self.v_slots.values()) + list(self.k_full.values())
                   + list(self.v_full.values()) + self.ck + self.ring)
        return sum(t.numel() * t.element_size() for t in tensors)

    def is_offloaded(self, layer: int) -> bool:
        """True if ``layer``'s K/V live on the host."""
        return layer not in self.resident

    def num_compressed(self, num_tokens: int) -> int:
        """Compressed keys complete after ``num_tokens`` tokens."""
        return ref.num_compressed(num_tokens, self.selection.kernel_size, self.selection.kernel_stride)

    # --------------------------------------------------------------- append
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, step) -> None:
        """Write this step's keys/values (``[B, H, Tq, d]``) and update compressed keys.

        Prefill writes one row from position 0 (host, ring, compressed keys; the prompt's
        K/V stay reachable through :meth:`view` while the layer runs). Decode writes one
        token per row (every row of the cache) after waiting for the layer's prefetch.
        ``step`` is the :class:`~sparda.model.llama.StepInfo` (``rows [B]``,
        ``q_pos [B, Tq]`` int64); ``k, v`` post-RoPE, cast to the cache dtype on write.

        Raises:
            SpardaError: a decode step that does not cover every cache row.
        """
        cfg = self.selection
        if step.phase == "prefill":
            row = int(step.rows[0])
            t = k.shape[-2]
            if layer in self.resident:
                self.k_full[layer][row, :, :t] = k[0]
                self.v_full[layer][row, :, :t] = v[0]
            else:
                self.host.write_tokens(layer, row, k[0], v[0])
                self.slot_map[layer][row] = -1
                start = (t - 1) // cfg.block_size * cfg.block_size
                self.k_slots[layer][row, :, self.slots, :t - start] = k[0, :, start:]
                self.v_slots[layer][row, :, self.slots, :t - start] = v[0, :, start:]
                self._stash = (layer, k, v)
            ck = ref.compress_keys(k[0], cfg.kernel_size, cfg.kernel_stride)
            self.ck[layer][row, :, :ck.shape[-2]] = ck
            pos = torch.arange(max(0, t - cfg.kernel_size), t, device=k.device)
            self.ring[layer][row, :, pos % cfg.kernel_size] = k[0, :, pos]
            if layer == self.num_layers - 1:
                self.lengths[row] = t
            return
        if step.rows.numel() != self.batch:
            raise SpardaError("offloaded decode steps must cover every cache row")
        self._stash = None
        rows = step.rows
        pos = step.q_pos[:, 0]
        if layer in self.resident:
            self.k_full[layer][rows, :, pos] = k[:, :, 0]
            self.v_full[layer][rows, :, pos] = v[:, :, 0]
        else:
            self.prefetcher.wait(layer)
            off = pos % cfg.block_size
            self.k_slots[layer][rows, :, self.slots, off] = k[:, :, 0]
            self.v_slots[layer][rows, :, self.slots, off] = v[:, :, 0]
            for chunk in self.host.chunks[layer]:
                self.engine.store_tokens(chunk, k[:, :, 0], v[:, :, 0], pos)
        ring = self.ring[layer]
        ring[rows, :, pos % cfg.kernel_size] = k[:, :, 0]
        # A compressed window completes when (pos + 1 - kernel) % stride == 0 (as DeviceKVCache).
        done = pos + 1 - cfg.kernel_size
        ready = (done >= 0) & (done % cfg.kernel_stride == 0)
        j = torch.where(ready, done // cfg.kernel_stride, 0)
        start = torch.where(ready, j * cfg.kernel_stride, 0)
        index = (start.view(-1, 1) + torch.arange(cfg.kernel_size, device=pos.device)) % cfg.kernel_size
        window = ring[rows.view(-1, 1), :, index]  # [B, k, H, d], oldest first
        new_ck = window.float().mean(1).to(self.ck[layer].dtype)
        old = self.ck[layer][rows, :, j]
        self.ck[layer][rows, :, j] = torch.where(ready.view(-1, 1, 1), new_ck, old)
        if layer == self.num_layers - 1:
            self.lengths[rows] = pos + 1

    # ----------------------------------------------------------------- view
    def compressed(self, layer: int) -> torch.Tensor:
        """The whole compressed-key buffer ``[B, H, C_cap, d]`` of ``layer`` (device)."""
        return self.ck[layer]

    def view(self, layer: int, rows: torch.Tensor, num_tokens: int):
        """K, V ``[b, H, num_tokens, d]`` and compressed keys ``[b, H, C, d]`` of ``rows``.

        Offloaded layers: in prefill the prompt's own K/V; in decode a full copy from the
        host (slow path, synchronises; offload-aware methods use :meth:`attend`).
        ``rows``: ``[b]`` int64; ``num_tokens`` in tokens; ``C = num_compressed(num_tokens)``.

        Raises:
            SpardaError: ``num_tokens`` exceeds the capacity.
        """
        if num_tokens > self.capacity:
            raise SpardaError(f"{num_tokens} tokens exceed the cache capacity {self.capacity}")
        ck = self.ck[layer][rows, :, :self.num_compressed(num_tokens)]
        if layer in self.resident:
            return self.k_full[layer][rows, :, :num_tokens], self.v_full[layer][rows, :, :num_tokens], ck
        if self._stash is not None and self._stash[0] == layer and self._stash[1].shape[-2] >= num_tokens:
            return self._stash[1][..., :num_tokens, :], self._stash[2][..., :num_tokens, :], ck
        if num_tokens == 0:
            empty = self.ck[layer].new_zeros(rows.numel(), self.ck[layer].shape[1], 0, self.ck[layer].shape[-1])
            return empty, empty, ck
        nb = -(-num_tokens // self.block_size)
        ks, vs = [], []
        for chunk in self.host.chunks[layer]:
            ks.append(chunk.k[:, :, :nb].flatten(2, 3))
            vs.append(chunk.v[:, :, :nb].flatten(2, 3))
        idx = rows.cpu()
        k = torch.cat(ks)[idx, :, :num_tokens].to(self.device)
        v = torch.cat(vs)[idx, :, :num_tokens].to(self.device)
        return k, v, ck

    # ---------------------------------------------------------- fetch/attend
    def fetch(self, layer: int, mask: torch.Tensor, pos: torch.Tensor, prefetch: bool = False) -> None:
        """Make ``layer``'s selected blocks resident in its slots (decode).

        Diffs ``mask`` (minus the current block, which lives in the partial slot) against
        the block map and copies only the misses: on a side stream with an event if
        ``prefetch`` (the layer's :meth:`append` / :meth:`attend` wait on it), else on the
        compute stream.

        Args:
            mask: ``[B, H, N']`` bool block selection (any ``N' <= N_cap``), device.
            pos: ``[B]`` int64 position of this step's token (its block is the current one).
        """
        if layer in self.resident:
            return
        n = mask.shape[-1]
        cur = (pos // self.block_size).view(-1, 1, 1)
        want = mask & (torch.arange(n, device=mask.device).view(1, 1, -1) != cur)
        load, new_map, hits, misses = diff_slots(self.slot_map[layer], want)
        self.slot_map[layer].copy_(new_map)
        ext = torch.cat([want, want.new_zeros(*want.shape[:2], 1)], -1)
        self._selected[layer] = torch.gather(ext, -1, torch.where(new_map < 0, n, new_map))
        k_slots, v_slots = self.k_slots[layer], self.v_slots[layer]
        chunks = self.host.chunks[layer]

        def copy() -> None:
            for chunk in chunks:
                self.engine.gather(chunk, k_slots, v_slots, load)

        self.prefetcher.fetch(layer, copy, hits, misses, keep=(load,), prefetch=prefetch)

    def wait(self, layer: int) -> None:
        """Make the compute stream wait for ``layer``'s pending prefetch (no host sync)."""
        self.prefetcher.wait(layer)

    def attend(self, layer: int, q: torch.Tensor, kv_len: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Decode attention of ``q [B, H, G, d]`` over the fetched blocks plus the current one.

        Uses the selection of the last :meth:`fetch` of ``layer``; exact softmax over
        those tokens with ``key < kv_len``. ``kv_len, pos``: ``[B]`` int64 (tokens; ``pos``
        is this step's position, its block the current one). Returns ``[B, H, G, d]`` in
        ``q``'s dtype.

        Raises:
            SpardaError: shape/dtype mismatch (Triton path of
                :func:`sparda.kernels.decode_attention_slots`).
            KeyError: no :meth:`fetch` of ``layer`` in this step.
        """
        from sparda import kernels

        self.wait(layer)
        slot_map = self.slot_map[layer]
        ids = torch.where(self._selected[layer], slot_map, -1)
        cur = (pos // self.block_size).view(-1, 1, 1).expand(*ids.shape[:2], 1)
        ids = torch.cat([ids, cur], -1)
        slot_ids = torch.arange(self.slots + 1, device=ids.device).view(1, 1, -1)
        return kernels.decode_attention_slots(q, self.k_slots[layer], self.v_slots[layer], ids, slot_ids,
                                              kv_len)

    def offload_stats(self, tokens: int, row: int | None = None) -> dict[str, float]:
        """Prefetch counters of cache row ``row`` (or the whole batch) over ``tokens`` decoded
        tokens (:meth:`~sparda.cache.prefetch.Prefetcher.stats`) plus the memory split."""
        stats = self.prefetcher.stats(tokens, row)
        stats.update(engine=self.engine.name, host_bytes=self.host.nbytes, device_bytes=self.device_bytes)
        return stats
