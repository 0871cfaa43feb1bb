"""Data-parallel Forecast training over ``torch.distributed`` (``--nproc``, docs/forecast.md):
one frozen model per rank, the Forecast's gradients summed by one all-reduce per step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparda.errors import SpardaError
from sparda.training.step import StepTotals


@dataclass
class Distributed:
    """This process's ``rank``, ``world_size`` and ``device`` (``cuda:LOCAL_RANK``, or the CPU)."""

    rank: int
    world_size: int
    device: torch.device

    @classmethod
    def from_env(cls, device=None) -> "Distributed | None":
        """Join the process group ``torchrun`` describes; ``None`` without torchrun. Raises SpardaError
        for ``cuda`` without CUDA or fewer GPUs than local ranks."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1 or "RANK" not in os.environ:
            return None
        local = int(os.environ.get("LOCAL_RANK", "0"))
        want = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if want.startswith("cuda"):
            if not torch.cuda.is_available() or local >= torch.cuda.device_count():
                raise SpardaError(f"rank {os.environ['RANK']} needs cuda:{local}, but "
                                  f"{torch.cuda.device_count()} GPUs are visible; lower --nproc or pass --device cpu")
            dev = torch.device("cuda", local)
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), dev)

    def my_slice(self, global_batch: int) -> range:
        """This rank's contiguous share of a global batch of ``global_batch`` sequences."""
        share = global_batch // self.world_size
        return range(self.rank * share, (self.rank + 1) * share)

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Give every rank rank 0's parameters, in place."""
        for p in module.parameters():
            dist.broadcast(p.data, 0)

    def reduce(self, module: torch.nn.Module, totals: StepTotals) -> StepTotals:
        """Sum ``module``'s gradients over ranks in place; return ``totals`` summed over ranks."""
        params = [p for p in module.parameters()]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n
        summed = totals.as_tensor().to(self.device)
        dist.all_reduce(summed)
        return StepTotals.from_tensor(summed.cpu())

    def any_flag(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def close(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()
