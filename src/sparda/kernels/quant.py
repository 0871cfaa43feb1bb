"""The KV-cache quantisation rule, used by every cache (docs/kv_quant.md, design §6.1).

``int8``/``int4``: asymmetric per token and KV head, ``lo = min(x)``, ``step = (max(x) - lo)
/ (2**bits - 1)``, ``q = round((x - lo) / step)``, ``x' = q * step + lo`` in fp32, so
``|x' - x| <= step / 2``; int4 packs element ``2i`` in the low nibble; ``(step, lo)`` is
stored as ``[..., 2]`` fp32. :class:`QuantizedKV` indexes like the tensor it replaces.
"""

from __future__ import annotations

import torch

from sparda.config import KV_DTYPES
from sparda.errors import SpardaError

__all__ = ["KV_DTYPES", "QuantizedKV", "dequantize", "quantize", "token_bytes"]
#: bits per value of each quantised type
BITS = {"int8": 8, "int4": 4}
#: fp32 numbers stored per token and head beside the data: ``(step, lo)``
SCALE_DIM = 2
#: dtype of the stored ``(step, lo)`` pair
SCALE_DTYPE = torch.float32
#: the host store's type under ``kv_dtype`` ``mixed`` (every block; hot ones also in bf16)
MIXED_STORE = "int4"


def is_quantized(kv_dtype: str) -> bool:
    """True for ``int8`` and ``int4`` (not ``mixed``)."""
    return kv_dtype in BITS


def store_dtype(kv_dtype: str) -> str:
    """The host store's type: ``kv_dtype``, or ``int4`` for ``mixed``."""
    return MIXED_STORE if kv_dtype == "mixed" else kv_dtype


def slot_dtype(kv_dtype: str) -> str:
    """The GPU buffers' type: ``kv_dtype``, or ``bf16`` (the model dtype) for ``mixed``."""
    return "bf16" if kv_dtype == "mixed" else kv_dtype


def packed_dim(head_dim: int, kv_dtype: str) -> int:
    """Bytes per token and head of quantised data: ``d`` (int8), ``d / 2`` (int4).

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
    """Bytes of one token of one KV head in K (or V) alone, scales included (``mixed``: its int4 store's)."""
    kv_dtype = store_dtype(kv_dtype)
    if not is_quantized(kv_dtype):
        return head_dim * torch.empty((), dtype=dtype).element_size()
    return packed_dim(head_dim, kv_dtype) + SCALE_DIM * torch.empty((), dtype=SCALE_DTYPE).element_size()


def max_error(scale: torch.Tensor) -> torch.Tensor:
    """Bound of quantize -> dequantize, ``[..., 1]`` from ``scale [..., 2]``: half a step."""
    return scale[..., :1] / 2


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., d]`` (any float dtype) per row (docs/kv_quant.md).

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
    # a tensor divisor: CUDA divides by a CPU scalar as a product with its reciprocal, up to one
    # ulp off the correctly rounded quotient that the Triton kernels compute (div_rn)
    step = (xf.amax(-1, keepdim=True) - lo) / torch.full_like(lo, levels)
    safe = torch.where(step > 0, step, torch.ones_like(step))  # a constant row: q = 0, x' = lo exactly
    q = ((xf - lo) / safe).round_().clamp_(0, levels).to(torch.uint8)
    if kv_dtype == "int4":
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q, torch.cat([step, lo], -1)


def dequantize(data: torch.Tensor, scale: torch.Tensor, kv_dtype: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``data [..., d']`` uint8, ``scale [..., 2]`` -> ``[..., d]`` in ``dtype``."""
    q = data
    if kv_dtype == "int4":
        q = torch.stack([data & 15, data >> 4], -1).flatten(-2)
    out = q.to(torch.float32) * scale[..., :1] + scale[..., 1:]
    return out.to(dtype)


class QuantizedKV:
    """A quantised K (or V) buffer that indexes like the ``[..., d]`` tensor it replaces.

    ``data [..., d']`` uint8, ``scale [..., 2]`` fp32, ``kv_dtype`` ``int8``/``int4``. Indexing
    (get and set; a float value is quantised) must leave the head dim whole.
    """

    __slots__ = ("data", "scale", "kv_dtype")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, kv_dtype: str) -> None:
        self.data, self.scale, self.kv_dtype = data, scale, kv_dtype

    @classmethod
    def zeros(cls, shape, kv_dtype: str, device=None, pin_memory: bool = False) -> "QuantizedKV":
        """Zero buffer of logical shape ``(..., d)``."""
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
        """Logical shape ``(..., d)``."""
        return torch.Size((*self.data.shape[:-1], self.head_dim))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes of data and scales."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def dim(self) -> int:
        return self.data.dim()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[..., d]`` values in ``dtype``."""
        return dequantize(self.data, self.scale, self.kv_dtype, dtype)

    def __getitem__(self, index) -> "QuantizedKV":
        return QuantizedKV(self.data[index], self.scale[index], self.kv_dtype)

    def __setitem__(self, index, value) -> None:
        if not isinstance(value, QuantizedKV):
            value = QuantizedKV.quantize(value, self.kv_dtype)
        self.data[index] = value.data.to(self.data.device)
        self.scale[index] = value.scale.to(self.scale.device)

    def copy_(self, src: "QuantizedKV", non_blocking: bool = False) -> "QuantizedKV":
        """Copy ``src`` (same shape, any device) in place."""
        self.data.copy_(src.data, non_blocking=non_blocking)
        self.scale.copy_(src.scale, non_blocking=non_blocking)
        return self

    def to(self, device, non_blocking: bool = False) -> "QuantizedKV":
        """Both parts on ``device``."""
        return QuantizedKV(self.data.to(device, non_blocking=non_blocking),
                           self.scale.to(device, non_blocking=non_blocking), self.kv_dtype)

    def flatten(self, start: int, end: int) -> "QuantizedKV":
        """Flatten leading dims ``start..end`` of both parts."""
        return QuantizedKV(self.data.flatten(start, end), self.scale.flatten(start, end), self.kv_dtype)

    def transpose(self, dim0: int, dim1: int) -> "QuantizedKV":
        """Swap two leading dims of both parts (not the head dim)."""
        return QuantizedKV(self.data.transpose(dim0, dim1), self.scale.transpose(dim0, dim1), self.kv_dtype)

    def contiguous(self) -> "QuantizedKV":
        return QuantizedKV(self.data.contiguous(), self.scale.contiguous(), self.kv_dtype)

    def record_stream(self, stream) -> None:
        self.data.record_stream(stream)
        self.scale.record_stream(stream)


def kv_zeros(shape, kv_dtype: str, dtype: torch.dtype, device=None, pin_memory: bool = False):
    """K (or V) buffer of logical shape ``(..., d)``: a ``dtype`` tensor, or :class:`QuantizedKV`."""
    if is_quantized(kv_dtype):
        return QuantizedKV.zeros(shape, kv_dtype, device, pin_memory=pin_memory)
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)


def as_float(buf, dtype: torch.dtype) -> torch.Tensor:
    """A cache buffer read as ``dtype`` values."""
    return buf.dequantize(dtype) if isinstance(buf, QuantizedKV) else buf


def cat(parts: list, dim: int = 0):
    """``torch.cat`` of cache buffers (:class:`QuantizedKV` along a leading dim)."""
    if isinstance(parts[0], QuantizedKV):
        return QuantizedKV(torch.cat([p.data for p in parts], dim), torch.cat([p.scale for p in parts], dim),
                           parts[0].kv_dtype)
    return torch.cat(parts, dim)
