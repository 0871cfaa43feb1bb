"""The KV-cache quantisation rule (docs/kv_quant.md): one place, used by every cache.

``kv_dtype`` is one of :data:`KV_DTYPES`:

* ``bf16``: no quantisation; K and V are stored in the model dtype (the name is the
  GPU default's: on the CPU the model dtype is fp32);
* ``int8`` / ``int4``: each token's ``d`` values of one KV head (K or V) are quantised
  asymmetrically on append, with their own step and offset (per token, per head)::

      lo, hi = min(x), max(x)              # over the head dim
      step = (hi - lo) / (2**bits - 1)     # fp32
      q = round((x - lo) / step)           # integers in [0, 2**bits - 1]
      x' = q * step + lo                   # dequantised, fp32

  so ``|x' - x| <= step / 2`` per element (half a quantisation step; plus fp32
  rounding of the two operations). ``int8`` stores ``q`` as one ``uint8`` per value;
  ``int4`` packs two values per byte (element ``2i`` in the low nibble, ``2i + 1`` in the
  high nibble; ``d`` must be even). The pair ``(step, lo)`` is stored beside the data as
  ``[..., 2]`` fp32 (8 bytes per token and head);
* ``mixed`` (offloaded caches only, :mod:`sparda.cache.hot`): the host store holds every
  block in ``int4`` (:data:`MIXED_STORE`) and a bounded pool of hot blocks in the model
  dtype; the GPU slots hold the model dtype (cold blocks are dequantised as they arrive).

Asymmetric rather than symmetric (``max|x|`` and signed levels): on the bundled model's
K/V its relative error is 28 % (K) / 18 % (V) lower at int8 and 32 % / 22 % lower at
int4 (``benchmarks/bench_kernels.py kv-quant-error``), for 4 more bytes per token and head.

:class:`QuantizedKV` is a quantised K (or V) buffer that indexes like the tensor it
replaces (any index that leaves the head dim whole), so the caches keep their indexing
code and only choose the buffer type. The Triton attention kernels read ``data`` and
``scale`` directly and dequantise in registers (:mod:`sparda.kernels.decode_attention`);
the PyTorch twins call :func:`dequantize`.
"""

from __future__ import annotations

import torch

from sparda.config import KV_DTYPES
from sparda.errors import SpardaError

__all__ = ["KV_DTYPES", "QuantizedKV", "check_kv_dtype", "dequantize", "quantize", "token_bytes"]
#: bits per value of each quantised type
BITS = {"int8": 8, "int4": 4}
#: fp32 numbers stored per token and head beside the data: ``(step, lo)``
SCALE_DIM = 2
#: dtype of the stored ``(step, lo)`` pair
SCALE_DTYPE = torch.float32
#: the host store's type under ``kv_dtype`` ``mixed`` (every block; hot ones also in bf16)
MIXED_STORE = "int4"


def check_kv_dtype(kv_dtype: str | None) -> str:
    """``kv_dtype`` validated (``None`` -> ``bf16``).

    Raises:
        SpardaError: not one of :data:`KV_DTYPES`.
    """
    name = "bf16" if kv_dtype is None else kv_dtype
    if name not in KV_DTYPES:
        raise SpardaError(f"unknown kv_dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)} "
                          "(--kv-dtype)")
    return name


def is_quantized(kv_dtype: str) -> bool:
    """True for ``int8`` and ``int4`` (not ``mixed``: ask :func:`store_dtype`)."""
    return kv_dtype in BITS


def store_dtype(kv_dtype: str) -> str:
    """The type every block is stored in on the host: ``kv_dtype`` itself, ``int4`` for ``mixed``."""
    return MIXED_STORE if kv_dtype == "mixed" else kv_dtype


def slot_dtype(kv_dtype: str) -> str:
    """The type of the GPU-side buffers (slots, resident layers): ``kv_dtype`` itself,
    ``bf16`` (the model dtype) for ``mixed``, whose cold blocks are dequantised on arrival."""
    return "bf16" if kv_dtype == "mixed" else kv_dtype


def packed_dim(head_dim: int, kv_dtype: str) -> int:
    """Bytes per token and head of the quantised data (``d`` for int8, ``d / 2`` for int4).

    Raises:
        SpardaError: int4 with an odd head dim.
    """
    if kv_dtype == "int4":
        if head_dim % 2:
            raise SpardaError(f"kv_dtype int4 packs two values per byte and needs an even head dim, "
                              f"got {head_dim}; use --kv-dtype int8")
        return head_dim // 2
    return head_dim


def token_bytes(head_dim: int, kv_dtype: str, dtype: torch.dtype) -> int:
    """Bytes one token of one KV head takes in K (or V) alone: ``d`` elements of ``dtype``
    unquantised, else the packed data plus the fp32 ``(step, lo)`` pair (``mixed``: its
    int4 store's; the bf16 hot pool is a fixed extra, :class:`~sparda.cache.host.HostKVStore`)."""
    kv_dtype = store_dtype(kv_dtype)
    if not is_quantized(kv_dtype):
        return head_dim * torch.empty((), dtype=dtype).element_size()
    return packed_dim(head_dim, kv_dtype) + SCALE_DIM * torch.empty((), dtype=SCALE_DTYPE).element_size()


def max_error(scale: torch.Tensor) -> torch.Tensor:
    """The bound of :func:`quantize` -> :func:`dequantize`: half a step per element,
    ``[..., 1]`` from ``scale [..., 2]`` (fp32 rounding aside)."""
    return scale[..., :1] / 2


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., d]`` (any float dtype) per row of the last dim (module doc).

    Returns:
        ``(data [..., packed_dim(d)] uint8, scale [..., 2] fp32 = (step, lo))``.
    Raises:
        SpardaError: an unquantised ``kv_dtype``, or int4 with an odd ``d``.
    """
    if not is_quantized(kv_dtype):
        raise SpardaError(f"quantize needs int8 or int4, got {kv_dtype!r}")
    packed_dim(x.shape[-1], kv_dtype)
    levels = 2 ** BITS[kv_dtype] - 1
    xf = x.to(torch.float32)
    lo = xf.amin(-1, keepdim=True)
    step = (xf.amax(-1, keepdim=True) - lo) / levels
    safe = torch.where(step > 0, step, torch.ones_like(step))  # a constant row: q = 0, x' = lo exactly
    q = ((xf - lo) / safe).round_().clamp_(0, levels).to(torch.uint8)
    if kv_dtype == "int4":
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q, torch.cat([step, lo], -1)


def dequantize(data: torch.Tensor, scale: torch.Tensor, kv_dtype: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``data [..., d']`` uint8, ``scale [..., 2]`` ->
    ``[..., d]`` in ``dtype`` (computed in fp32: ``q * step + lo``)."""
    q = data
    if kv_dtype == "int4":
        q = torch.stack([data & 15, data >> 4], -1).flatten(-2)
    out = q.to(torch.float32) * scale[..., :1] + scale[..., 1:]
    return out.to(dtype)


class QuantizedKV:
    """A quantised K (or V) buffer that indexes like the ``[..., d]`` tensor it replaces.

    Attributes:
        data: ``[..., d']`` uint8 (``d' = packed_dim(d, kv_dtype)``).
        scale: ``[..., 2]`` fp32, ``(step, lo)`` per token and head.
        kv_dtype: ``int8`` or ``int4``.

    ``buf[index]`` gives a :class:`QuantizedKV` view (or copy, for advanced indices) of
    both parts; ``buf[index] = x`` quantises a float tensor ``x`` (or copies another
    :class:`QuantizedKV`) into both. ``index`` must leave the head dim whole (the last
    dim untouched or a full slice).
    """

    __slots__ = ("data", "scale", "kv_dtype")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, kv_dtype: str) -> None:
        self.data, self.scale, self.kv_dtype = data, scale, kv_dtype

    @classmethod
    def zeros(cls, shape, kv_dtype: str, device=None, pin_memory: bool = False) -> "QuantizedKV":
        """A zero buffer of logical shape ``shape = (..., d)`` (dequantises to 0)."""
        *lead, d = shape
        data = torch.zeros((*lead, packed_dim(d, kv_dtype)), dtype=torch.uint8, device=device,
                           pin_memory=pin_memory)
        scale = torch.zeros((*lead, SCALE_DIM), dtype=SCALE_DTYPE, device=device, pin_memory=pin_memory)
        return cls(data, scale, kv_dtype)

    @classmethod
    def quantize(cls, x: torch.Tensor, kv_dtype: str) -> "QuantizedKV":
        """``x [..., d]`` quantised by :func:`quantize`."""
        return cls(*quantize(x, kv_dtype), kv_dtype)

    @property
    def head_dim(self) -> int:
        return self.data.shape[-1] * (2 if self.kv_dtype == "int4" else 1)

    @property
    def shape(self) -> torch.Size:
        """The logical shape ``(..., d)``."""
        return torch.Size((*self.data.shape[:-1], self.head_dim))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held by data and scales."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def dim(self) -> int:
        return self.data.dim()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[..., d]`` values in ``dtype`` (:func:`dequantize`)."""
        return dequantize(self.data, self.scale, self.kv_dtype, dtype)

    def __getitem__(self, index) -> "QuantizedKV":
        return QuantizedKV(self.data[index], self.scale[index], self.kv_dtype)

    def __setitem__(self, index, value) -> None:
        if not isinstance(value, QuantizedKV):
            value = QuantizedKV.quantize(value, self.kv_dtype)
        self.data[index] = value.data.to(self.data.device)
        self.scale[index] = value.scale.to(self.scale.device)

    def copy_(self, src: "QuantizedKV", non_blocking: bool = False) -> "QuantizedKV":
        """Copy ``src`` (same shape, any device) into this buffer in place."""
        self.data.copy_(src.data, non_blocking=non_blocking)
        self.scale.copy_(src.scale, non_blocking=non_blocking)
        return self

    def to(self, device, non_blocking: bool = False) -> "QuantizedKV":
        """Both parts on ``device``."""
        return QuantizedKV(self.data.to(device, non_blocking=non_blocking),
                           self.scale.to(device, non_blocking=non_blocking), self.kv_dtype)

    def flatten(self, start: int, end: int) -> "QuantizedKV":
        """Flatten leading dims ``start..end`` (not the head dim) of both parts."""
        return QuantizedKV(self.data.flatten(start, end), self.scale.flatten(start, end), self.kv_dtype)

    def contiguous(self) -> "QuantizedKV":
        return QuantizedKV(self.data.contiguous(), self.scale.contiguous(), self.kv_dtype)

    def record_stream(self, stream) -> None:
        self.data.record_stream(stream)
        self.scale.record_stream(stream)


def kv_zeros(shape, kv_dtype: str, dtype: torch.dtype, device=None, pin_memory: bool = False):
    """A K (or V) buffer of logical shape ``(..., d)``: a ``dtype`` tensor for ``bf16``
    (no quantisation), else a :class:`QuantizedKV`."""
    if is_quantized(kv_dtype):
        return QuantizedKV.zeros(shape, kv_dtype, device, pin_memory=pin_memory)
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)


def as_float(buf, dtype: torch.dtype) -> torch.Tensor:
    """A cache buffer (tensor or :class:`QuantizedKV`) read as ``dtype`` values."""
    return buf.dequantize(dtype) if isinstance(buf, QuantizedKV) else buf


def cat(parts: list, dim: int = 0):
    """``torch.cat`` of cache buffers (tensors, or :class:`QuantizedKV` along a leading dim)."""
    if isinstance(parts[0], QuantizedKV):
        return QuantizedKV(torch.cat([p.data for p in parts], dim), torch.cat([p.scale for p in parts], dim),
                           parts[0].kv_dtype)
    return torch.cat(parts, dim)
