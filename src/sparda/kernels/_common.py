"""Small helpers shared by the Triton launchers (no kernels here)."""

from __future__ import annotations

import functools

import torch

from sparda.errors import SpardaError


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)``."""
    return 1 << max(int(n) - 1, 0).bit_length()


def check_head_dim(d: int) -> None:
    """Check that head dim ``d`` (elements) is a power of two >= 16, which the kernels tile whole.

    Raises:
        SpardaError: otherwise.
    """
    if d < 16 or d & (d - 1):
        raise SpardaError(f"this Triton kernel tiles the head dim in one piece and needs a power of two "
                          f">= 16, got {d}; call the dispatching function in sparda.kernels instead, which "
                          "runs the PyTorch twin for such head dims")


def supported_head_dim(d: int) -> bool:
    """True if :func:`check_head_dim` would accept ``d``."""
    return d >= 16 and not d & (d - 1)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SM count of ``device`` (cached per GPU); 4 off-GPU (the Triton interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def tl_float_dtype_ok(t: torch.Tensor, name: str) -> None:
    """Check that kernel operand ``t`` (any shape) is fp16, bf16 or fp32.

    Raises:
        SpardaError: otherwise, naming ``name``.
    """
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise SpardaError(f"{name} must be fp16, bf16 or fp32, got {t.dtype}")


def patch_interpreter_for_numpy() -> None:
    """Let Triton 3.6's interpreter (``TRITON_INTERPRET=1``) run under NumPy >= 2.4, which
    refuses ``int()`` of a 1-element array. Tests and ``bench_kernels.py timing --smoke`` call it.
    """
    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_sparda_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._sparda_patched = True
    interp._patch_lang_tensor = patched
