"""What every KV cache has, and the state it owns (design §3.10).

A KV cache owns everything that lives as long as its rows do: the K/V and compressed
keys (its subclasses), the per-row lengths, the attention method's decode counters and
the stateful selectors' per-row state. A method reads and writes them through the cache
it is handed at each call, so two caches on one model (an engine's and that of a
``generate`` between its steps) never share counters, and a CUDA graph captured on a
cache keeps adding into that cache's tensors.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


class KVCache:
    """Base of :class:`~sparda.cache.device.DeviceKVCache` and
    :class:`~sparda.cache.offload.OffloadKVCache`.

    Args:
        batch: rows ``B``. capacity: tokens per row. device: where ``lengths`` and the
            counters live.
    Attributes:
        lengths: ``[B]`` int64, tokens stored per row.
        capacity: tokens per row.
        counters: decode counters of the attention method, ``blocks_read`` and
            ``blocks_valid`` (KV blocks summed over KV heads, layers and steps): host ``0.0``
            until the first decode step, then ``[B]`` int64 on the device, added to in place
            (a step of the first ``b`` rows adds to the first ``b``).
        decode_runner: the :class:`~sparda.engine.graph_runner.DecodeRunner` of this cache,
            made at its first decode step (``None`` before).
        prefetcher: an offloaded cache's :class:`~sparda.cache.prefetch.Prefetcher`, else ``None``.
        engine: an offloaded cache's transfer engine, else ``None``.
        slot_map: an offloaded cache's block -> GPU slot map per offloaded layer, else empty.
    """

    #: whether the K/V of (some) layers live in host memory and are fetched per step
    offload = False
    #: :meth:`append` takes a batched prefill (``StepInfo.row_lengths``, design §3.8)
    batched_prefill = True

    def __init__(self, batch: int, capacity: int, device: torch.device | str) -> None:
        self.capacity = capacity
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.counters: dict[str, object] = {"blocks_read": 0.0, "blocks_valid": 0.0}
        self.decode_runner = None
        self.prefetcher = None
        self.engine = None
        self.slot_map: dict[int, torch.Tensor] = {}
        self._owned: dict[object, dict[str, object]] = {}

    # ----------------------------------------------------------------- state
    def owned(self, owner: object, make: Callable[[], dict[str, object]]) -> dict[str, object]:
        """The state ``owner`` (a selector's :class:`~sparda.attention.row_state.RowState`)
        keeps in this cache, made by ``make()`` at its first use (in inference mode)."""
        state = self._owned.get(owner)
        if state is None:
            with torch.inference_mode():
                state = self._owned[owner] = make()
        return state

    def _row_history(self) -> list[torch.Tensor]:
        """The ``[B, ...]`` tensors of per-row decode history that a prefill does not rebuild:
        the selectors' state (:meth:`owned`); subclasses add theirs."""
        def tensors(value):
            if torch.is_tensor(value):
                if value.dim() and value.shape[0] == self.lengths.shape[0]:
                    yield value
            elif isinstance(value, (list, tuple, dict)):
                for item in value.values() if isinstance(value, dict) else value:
                    yield from tensors(item)
        return [t for state in self._owned.values() for t in tensors(state)]

    def decode_state(self, row: int) -> list[torch.Tensor]:
        """Copies of row ``row``'s decode history (:meth:`_row_history`), saved when its request
        is preempted (design §3.11) and put back by :meth:`restore_decode_state` once its
        recompute prefill ends, so it goes on as if it had not been preempted."""
        return [t[row].clone() for t in self._row_history()]

    def restore_decode_state(self, row: int, saved: list[torch.Tensor]) -> None:
        """Row ``row`` (any row) takes the history :meth:`decode_state` saved (in place)."""
        with torch.inference_mode():
            for tensor, value in zip(self._row_history(), saved, strict=True):
                tensor[row] = value

    def counter(self, key: str, rows: int, device) -> torch.Tensor:
        """The first ``rows`` entries (a view) of the ``[B]`` int64 counter ``key`` on
        ``device``: a decode step of the cache's first ``rows`` rows counts into them (design
        §3.13). Made once (zeroed, plus any host count of earlier steps), so that what a
        captured graph adds into is never replaced."""
        cur = self.counters[key]
        if not (torch.is_tensor(cur) and cur.device == torch.device(device)):
            tensor = torch.zeros(self.lengths.shape[0], dtype=torch.long, device=device)
            if not torch.is_tensor(cur):  # host counts of earlier steps carry over
                tensor.add_(int(cur))
            self.counters[key] = cur = tensor
        return cur[:rows]

    def reset_counters(self) -> None:
        """Zero the decode counters (device ones in place: a captured graph keeps counting)."""
        for key, value in self.counters.items():
            if torch.is_tensor(value):
                with torch.inference_mode():
                    value.zero_()
            else:
                self.counters[key] = 0.0

    def read_fraction(self, row: int | None = None) -> float:
        """Fraction of causally valid KV blocks read per decode step (1.0 = dense), summed
        over KV heads, layers and steps: of row ``row``, or of the whole batch."""
        read, valid = self.counters["blocks_read"], self.counters["blocks_valid"]
        if row is not None and torch.is_tensor(valid):
            read, valid = read[row], valid[row]
        read, valid = float(torch.as_tensor(read).sum()), float(torch.as_tensor(valid).sum())
        return read / valid if valid else 1.0

    # ----------------------------------------------------------------- reads
    def compressed_keys(self, layer: int, rows, num_tokens: int) -> torch.Tensor:
        """Compressed keys ``[b, H, C, d]`` of ``layer`` for ``rows`` (``[b]`` int64 or a
        slice, :attr:`StepInfo.cache_rows`) and the first ``num_tokens`` tokens (``C =
        num_compressed(num_tokens)``), in the cache dtype."""
        return self.view(layer, rows, num_tokens)[2]

    def chunked_prefill(self):
        """Context of one prefill (a prompt's chunks, or one batched forward): nothing to
        set up on the device; an offloaded cache keeps its host writes in flight."""
        return contextlib.nullcontext()

    def end_prefill(self) -> None:
        """Drop what a prefill kept for its own reads (nothing on the device; an offloaded
        cache: the running layer's K/V), after K/V were appended outside :meth:`chunked_prefill`."""

    def view(self, layer: int, rows: torch.Tensor, num_tokens: int):  # pragma: no cover - interface
        raise NotImplementedError
