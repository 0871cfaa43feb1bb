"""Chunked prefill into the offloaded KV cache (design §6): what a later chunk needs.

A prompt prefilled in chunks (:meth:`sparda.LLM.prefill`, ``prefill_chunk_tokens``) attends,
chunk by chunk, to every earlier token of the layer; the offloaded cache keeps those in
host memory only. Per offloaded layer and chunk, :class:`PrefillStaging`:

* reads the layer's earlier tokens back from the host store into a device buffer of one
  layer's capacity (on CUDA on a side stream: the read of layer ``l+1`` is started while
  layer ``l`` computes, into the second of two buffers);
* writes the chunk's own K/V to the host store (on CUDA on the same side stream, so the
  next chunk's read of that layer follows it, while the compute stream goes on; on the
  CPU synchronously).

GPU memory during prefill is therefore the weights, one chunk's activations, the on-GPU
part of the cache and these two buffers (``2 x 2 x H_kv x capacity x d`` elements), not
the whole prompt's K/V of every layer. No host synchronisation: the streams are ordered
by events (:meth:`PrefillStaging.finish` joins them).
"""

from __future__ import annotations

import torch

from sparda.kernels import quant


class PrefillStaging:
    """Device buffers and host writes of one chunked prefill (see the module docstring).

    Args:
        host: the :class:`~sparda.cache.host.HostKVStore`.
        offloaded: the offloaded layers (in order).
        num_kv_heads, head_dim, capacity: buffer shape ``[H_kv, capacity, d]`` per K and V.
        dtype, device: of the buffers.
        asynchronous: on CUDA, copy on a side stream (else on the compute stream,
            synchronously, as the CPU).
        kv_dtype: ``bf16``, or ``int8``/``int4``: the buffers hold the host's quantised
            bytes (:class:`~sparda.kernels.quant.QuantizedKV`) and :meth:`write` takes them.
    """

    def __init__(self, host, offloaded, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device, asynchronous: bool, kv_dtype: str = "bf16") -> None:
        self.host = host
        self.kv_dtype = kv_dtype
        self.offloaded = tuple(offloaded)
        self.shape = (num_kv_heads, capacity, head_dim)
        self.dtype, self.device = dtype, device
        self.stream = torch.cuda.Stream(device) if asynchronous and device.type == "cuda" else None
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pending: dict[int, tuple[torch.cuda.Event, int, int]] = {}  # layer -> (event, row, start)

    @staticmethod
    def buffer_bytes(num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, kv_dtype: str,
                     asynchronous: bool) -> int:
        """Bytes of the buffers at most (K and V of two, one without a side stream)."""
        count = 2 if asynchronous else 1
        return count * 2 * num_kv_heads * capacity * quant.token_bytes(head_dim, quant.store_dtype(kv_dtype), dtype)

    def _buffer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffer of ``layer``: consecutive offloaded layers alternate between two (one
        without a side stream), allocated on first use."""
        count = 2 if self.stream is not None else 1
        while len(self.buffers) < count:
            if quant.is_quantized(self.kv_dtype):
                self.buffers.append((quant.QuantizedKV.zeros(self.shape, self.kv_dtype, self.device),
                                     quant.QuantizedKV.zeros(self.shape, self.kv_dtype, self.device)))
            else:
                self.buffers.append((torch.empty(self.shape, dtype=self.dtype, device=self.device),
                                     torch.empty(self.shape, dtype=self.dtype, device=self.device)))
        return self.buffers[self.offloaded.index(layer) % count]

    def _read(self, layer: int, row: int, start: int) -> None:
        """Copy host tokens ``< start`` of ``layer``/``row`` into the layer's buffer, through
        the block table (:meth:`~sparda.cache.host.HostKVStore.get_tokens`).

        Raises:
            SpardaError: a block of those tokens has no page (internal error).
        """
        self.host.get_tokens(layer, row, start, *self._buffer(layer), non_blocking=self.stream is not None)

    def history(self, layer: int, row: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` device buffers ``[H_kv, capacity, d]`` whose tokens ``< start`` are
        ``layer``'s earlier chunks (prefetched by :meth:`prefetch` or read now); the
        caller writes this chunk's tokens after them."""
        pending = self.pending.pop(layer, None)
        if self.stream is None:
            self._read(layer, row, start)
        elif pending is not None and pending[1:] == (row, start):
            torch.cuda.current_stream(self.device).wait_event(pending[0])
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self._read(layer, row, start)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return self._buffer(layer)

    def prefetch(self, layer: int, row: int, start: int) -> None:
        """Start reading ``layer``'s tokens ``< start`` on the side stream (CUDA; no-op
        otherwise, for a resident layer, a first chunk or an already pending read)."""
        if self.stream is None or start == 0 or layer not in self.offloaded or layer in self.pending:
            return
        # the buffer is free once the compute stream's work so far (the layer two before) is done
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._read(layer, row, start)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending[layer] = (event, row, start)

    def write(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Write a chunk's ``k, v [H_kv, T, d]`` to host tokens ``start .. start+T-1`` (through
        the block table, :meth:`~sparda.cache.host.HostKVStore.put_tokens`).

        Raises:
            SpardaError: a block of those tokens has no page (internal error).
        """
        if self.stream is None:
            self.host.write_tokens(layer, row, k, v, start)
            return
        srcs = (k.contiguous(), v.contiguous())
        self.host.token_runs(layer, row, start, start + srcs[0].shape[1])  # every page checked before any copy
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.host.put_tokens(layer, row, *srcs, start)
        for src in srcs:
            src.record_stream(self.stream)  # kept alive until the side stream has read it

    def finish(self) -> None:
        """Make the compute stream wait for every pending host write and read (no host sync)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.pending.clear()
