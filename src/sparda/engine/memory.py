"""KV-pool sizing (design §3.11): the bytes a KV cache takes, and how many rows fit a budget.

:func:`kv_need_bytes` counts what a cache of ``batch`` rows x ``capacity`` tokens allocates
on the device and in host memory (K/V in their storage type, scales included; slots and
resident layers of an offloaded cache; compressed keys and the quantised caches' key ring).
:func:`plan_rows` turns ``sparda serve``'s budgets (``--gpu-memory-utilization``,
``--host-memory-gib``) into the number of KV rows it allocates, or refuses with the limit.
"""

from __future__ import annotations

import dataclasses

import torch

from sparda.config import GPU_SHARE, HOST_SHARE
from sparda.errors import SpardaError
from sparda.kernels import quant
from sparda.kernels import reference as ref

#: GPU memory kept free of the KV pool for activations (prefill chunks, logits, graphs)
ACTIVATION_RESERVE_BYTES = 2 * 2**30


def kv_need_bytes(shape, selection, kv_dtype: str, dtype: torch.dtype, batch: int, capacity: int, *,
                  offload: bool, resident_layers=(), slot_factor: float = 1.5,
                  hot_blocks: int | None = None, state_bytes: int = 0,
                  host_blocks: int | None = None) -> tuple[int, int]:
    """``(device_bytes, host_bytes)`` of a KV cache of ``batch`` rows x ``capacity`` tokens.

    On the device (``offload`` False): K/V of every layer in ``kv_dtype``. Offloaded (design
    §6): ``resident_layers`` whole and ``S + 1`` slots per other layer on the device with
    their block maps, the slot diff's lists and the block tables (int32), and on the host
    ``host_blocks`` pages of every other layer (:func:`host_page_bytes` each; ``None``:
    ``batch * ceil(capacity / block_size)``, a whole capacity per row); ``mixed`` (design
    §6.1) adds the bf16 hot pool of ``hot_blocks`` blocks per row on the host, the int4
    staging of the cold slots and the hot-block state on the device. Both add the compressed
    keys (and, quantised or offloaded, the ring of the last ``kernel`` keys) and
    ``state_bytes``, the selector's per-row state (``AttentionMethod.state_bytes``).
    """
    from sparda.cache.hot import default_hot_blocks
    from sparda.cache.offload import num_slots, spare_slot_count

    heads, d, layers = shape.num_kv_heads, shape.head_dim, shape.num_layers
    elem = torch.empty((), dtype=dtype).element_size()

    def kv(kind: str, tokens: int) -> int:  # K and V of ``tokens`` tokens in every KV head of every row
        return 2 * batch * heads * tokens * quant.token_bytes(d, kind, dtype)

    num_ck = max(ref.num_compressed(capacity, selection.kernel_size, selection.kernel_stride), 1)
    keys = layers * batch * heads * num_ck * d * elem
    if offload or quant.is_quantized(kv_dtype):
        keys += layers * batch * heads * selection.kernel_size * d * elem
    keys += state_bytes
    if not offload:
        return layers * kv(kv_dtype, capacity) + keys, 0
    bs = selection.block_size
    blocks = -(-capacity // bs)
    slots = spare_slot_count(capacity, selection, slot_factor)
    resident = len({layer for layer in resident_layers if 0 <= layer < layers})
    offloaded = layers - resident
    device = resident * kv(quant.slot_dtype(kv_dtype), capacity) + offloaded * kv(quant.slot_dtype(kv_dtype),
                                                                                   (slots + 1) * bs)
    width = num_slots(capacity, selection)
    # per offloaded layer: slot_map and load [B, H, S] int64, attn_ids [B, H, S + 1] and
    # attn_blocks, attn_slots [B, H, W + 1] int32
    device += offloaded * batch * heads * (2 * slots * 8 + (slots + 1) * 4 + 2 * (width + 1) * 4)
    device += batch * blocks * 4  # the block table [B, N] int32
    pages = batch * blocks if host_blocks is None else host_blocks
    host = pages * host_page_bytes(shape, selection, kv_dtype, dtype, resident_layers=resident_layers)
    if kv_dtype == "mixed":
        pool = min(default_hot_blocks(selection) if hot_blocks is None else hot_blocks, blocks)
        host += offloaded * 2 * batch * heads * pool * bs * d * elem
        device += offloaded * kv(quant.MIXED_STORE, slots * bs)
        device += offloaded * batch * heads * blocks * (1 + 8)  # HotBlocks: hot bool, last int64
        device += batch * pool * 4  # the hot pool's (identity) block table
    return device + keys, host


def host_page_bytes(shape, selection, kv_dtype: str, dtype: torch.dtype, *, resident_layers=()) -> int:
    """Host bytes of one page of every offloaded layer: K and V of one block of
    ``block_size`` tokens for every KV head, in the store's type (scales included; ``mixed``:
    int4, its hot pool is per row, not per page). ``host_budget // host_page_bytes(...)`` is
    the ``host_blocks`` a budget holds."""
    resident = len({layer for layer in resident_layers if 0 <= layer < shape.num_layers})
    token = quant.token_bytes(shape.head_dim, quant.store_dtype(kv_dtype), dtype)
    return (shape.num_layers - resident) * 2 * shape.num_kv_heads * selection.block_size * token


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The KV pool :func:`plan_rows` chose: ``rows`` of ``capacity`` tokens, the bytes they
    take and the budgets they were checked against (``None``: no such budget)."""

    rows: int
    capacity: int
    device_bytes: int
    host_bytes: int
    device_budget: int | None
    host_budget: int | None
    fits: int
    #: a paged host store (design §3.11): its KV blocks and their tokens each; ``None``: rows
    host_blocks: int | None = None
    block_size: int = 0

    def line(self) -> str:
        """One line for the start-up log."""
        if self.host_blocks is not None:
            tokens = self.host_blocks * self.block_size
            head = (f"KV pool {self.rows} rows of up to {self.capacity} tokens, {self.host_blocks} host blocks of "
                    f"{self.block_size} tokens ({tokens} tokens, {tokens / self.capacity:.1f} full rows)")
        else:
            head = f"KV pool {self.rows} rows x {self.capacity} tokens"
        parts = []
        if self.device_budget is not None:
            parts.append(f"device {size_text(self.device_bytes)} of {size_text(self.device_budget)}")
        if self.host_budget is not None:
            parts.append(f"host {size_text(self.host_bytes)} of {size_text(self.host_budget)}")
        # paged, ``fits`` counts rows that hold one block each: the ceiling --max-batch may rise to
        room = (f"the budgets allow up to {self.fits} rows" if self.host_blocks is not None
                else f"room for {self.fits} rows")
        return head + (": " + ", ".join(parts) if parts else "") + ", " + room


def size_text(nbytes: float) -> str:
    """``nbytes`` as GiB, or MiB below 0.01 GiB (two decimals)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 0.01 * 2**30 else f"{nbytes / 2**20:.2f} MiB"


def check_budgets(gpu_memory_utilization: float, host_memory_gib: float | None) -> None:
    """Raise SpardaError unless ``gpu_memory_utilization`` is in ``(0, 1]`` and
    ``host_memory_gib`` is ``None`` or a finite number > 0 (before any work: ``sparda serve``
    calls it before the model loads)."""
    number = (int, float)
    if isinstance(gpu_memory_utilization, bool) or not (isinstance(gpu_memory_utilization, number)
                                                        and 0 < gpu_memory_utilization <= 1):
        raise SpardaError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    if host_memory_gib is not None and (isinstance(host_memory_gib, bool) or not (
            isinstance(host_memory_gib, number) and 0 < host_memory_gib < float("inf"))):
        raise SpardaError(f"--host-memory-gib must be a finite number of GiB > 0, got {host_memory_gib!r}")


def budgets(runner, capacity: int, gpu_memory_utilization: float,
            host_memory_gib: float | None) -> tuple[int | None, int | None]:
    """``(device, host)`` bytes the KV pool may take: on CUDA, ``gpu_memory_utilization`` of
    the GPU's memory less what is allocated now (the weights), at most what is free now (other
    processes), less :data:`ACTIVATION_RESERVE_BYTES` and an offloaded cache's prefill staging
    (two layers' K/V of one row); on the CPU no device budget (the device is host memory).
    Host: ``host_memory_gib``, or :data:`HOST_SHARE` of the memory available now (``None`` if
    the OS does not say).

    Raises:
        SpardaError: ``gpu_memory_utilization`` outside ``(0, 1]`` or ``host_memory_gib`` not a
            finite number > 0.
    """
    from sparda.cache.chunked_prefill import PrefillStaging
    from sparda.cache.host import available_host_bytes

    check_budgets(gpu_memory_utilization, host_memory_gib)
    device = None
    if runner.device.type == "cuda":
        total = torch.cuda.get_device_properties(runner.device).total_memory
        free, _ = torch.cuda.mem_get_info(runner.device)
        room = min(int(gpu_memory_utilization * total) - torch.cuda.memory_allocated(runner.device), free)
        s, kv_dtype = runner.shape, runner.config.cache.kv_dtype
        staging = PrefillStaging.buffer_bytes(s.num_kv_heads, s.head_dim, capacity, runner.dtype, kv_dtype,
                                     asynchronous=True) if runner.offloaded else 0
        device = max(0, room - ACTIVATION_RESERVE_BYTES - staging)
    if host_memory_gib is not None:
        host = int(host_memory_gib * 2**30)
    else:
        free = available_host_bytes()
        host = None if free is None else int(HOST_SHARE * free)
    return device, host


def plan_rows(runner, capacity: int, max_batch: int, *, gpu_memory_utilization: float = GPU_SHARE,
              host_memory_gib: float | None = None) -> MemoryPlan:
    """The KV rows ``sparda serve`` allocates: ``max_batch``, or fewer if the budgets
    (:func:`budgets`) hold fewer rows of ``capacity`` tokens (on the CPU the device cache
    counts against the host budget).

    Raises:
        SpardaError: not even one row fits; the message names the bytes of one row, the
            budget and the options that change them.
    """
    device_budget, host_budget = budgets(runner, capacity, gpu_memory_utilization, host_memory_gib)
    dev_row, host_row = runner.kv_bytes(1, capacity)
    if runner.device.type != "cuda":  # one memory: the device cache is host memory too
        dev_row, host_row = 0, dev_row + host_row
    bounds = [budget // row for budget, row in ((device_budget, dev_row), (host_budget, host_row))
              if budget is not None and row > 0]
    fits = min(bounds) if bounds else max_batch
    if fits < 1:
        short = [f"{name} {size_text(row)} of a {size_text(budget)} budget ({flag})"
                 for name, row, budget, flag in (("device", dev_row, device_budget, "--gpu-memory-utilization"),
                                                 ("host", host_row, host_budget, "--host-memory-gib"))
                 if budget is not None and row > budget]
        other = "--offload or a smaller --kv-dtype" if runner.device.type == "cuda" else "a smaller --kv-dtype"
        raise SpardaError(f"one KV row of {capacity} tokens does not fit: it needs {'; '.join(short)}; lower "
                          f"--max-model-len, raise the budget, or use {other}")
    rows = min(max_batch, fits)
    dev, host = runner.kv_bytes(rows, capacity)
    if runner.device.type != "cuda":
        dev, host = 0, dev + host
    return MemoryPlan(rows=rows, capacity=capacity, device_bytes=dev, host_bytes=host, device_budget=device_budget,
                      host_budget=host_budget, fits=fits)


def plan_pool(runner, capacity: int, max_batch: int, *, gpu_memory_utilization: float = GPU_SHARE,
              host_memory_gib: float | None = None) -> MemoryPlan:
    """The KV pool of a paged offloaded cache (design §3.11): ``max_batch`` rows, or as many
    as the device budget holds (a row's slots, compressed keys and resident layers), and as
    many host KV blocks as the host budget holds after the rows' fixed host bytes (``mixed``'s
    hot pool), at most every row's full ``capacity``; on the CPU both share the host budget.
    When every row's whole ``capacity`` fits, ``host_blocks`` is ``None``: an unpaged cache
    (the identity block table) serves the same requests.

    Raises:
        SpardaError: not even one row with one host block fits the budgets (the message
            names the bytes, the budgets and the options that change them).
    """
    device_budget, host_budget = budgets(runner, capacity, gpu_memory_utilization, host_memory_gib)
    bs = runner.config.selection.block_size
    full = -(-capacity // bs)
    dev_row, fixed_row = runner.kv_bytes(1, capacity, host_blocks=0)
    page = runner.kv_bytes(1, capacity, host_blocks=1)[1] - fixed_row
    cpu = runner.device.type != "cuda"
    per_row = dev_row + fixed_row + page if cpu else dev_row  # a row and at least one block
    fits = max_batch
    if device_budget is not None and not cpu:
        fits = device_budget // max(dev_row, 1)
    if host_budget is not None:
        fits = min(fits, host_budget // max(per_row if cpu else fixed_row + page, 1))
    if fits < 1 and cpu:
        raise SpardaError(f"one KV row of {capacity} tokens does not fit: with its first block it needs "
                          f"{size_text(per_row)} of host memory (on the CPU the whole cache is host memory), of a budget "
                          f"of {size_text(host_budget)} (--host-memory-gib); lower --max-model-len or raise "
                          "--host-memory-gib")
    if fits < 1:
        raise SpardaError(f"one KV row of {capacity} tokens does not fit: it needs {size_text(dev_row)} on the device "
                          f"and {size_text(fixed_row + page)} of host memory for its first block, of budgets "
                          f"{'none' if device_budget is None else size_text(device_budget)} (--gpu-memory-utilization) "
                          f"and {'none' if host_budget is None else size_text(host_budget)} (--host-memory-gib); lower "
                          "--max-model-len or raise the budgets")
    rows = min(max_batch, fits)
    dev, fixed = runner.kv_bytes(rows, capacity, host_blocks=0)
    room = None if host_budget is None else host_budget - fixed - (dev if cpu else 0)
    blocks = rows * full if room is None else max(1, min(rows * full, room // max(page, 1)))
    dev, host = runner.kv_bytes(rows, capacity, host_blocks=blocks)
    if cpu:
        dev, host = 0, dev + host
    paged = blocks < rows * full  # else every row whole: the identity block table, no paging
    return MemoryPlan(rows=rows, capacity=capacity, device_bytes=dev, host_bytes=host, device_budget=device_budget,
                      host_budget=host_budget, fits=fits, host_blocks=blocks if paged else None,
                      block_size=bs if paged else 0)
