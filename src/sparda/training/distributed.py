"""Data-parallel Forecast training over ``torch.distributed`` (issue #17): one frozen model
per rank, the Forecast's gradients summed across ranks after every step.

Launch with ``torchrun --nproc-per-node N -m sparda.cli train-forecast ...`` (or
``sparda train-forecast --nproc N``, which starts torchrun). Every rank draws the same
global batch from the seeded order (:class:`sparda.training.data.Batches`) and takes its
own contiguous slice of it, so the ranks read disjoint sequences and a sequence's loss
query tokens depend on its place in the global batch, not on the rank
(:func:`sparda.training.step.query_positions`). Each rank backpropagates its sequences
with weight ``1 / global batch``; the gradients are then summed with one
``all_reduce`` (NCCL on CUDA, gloo on the CPU) — the collective DDP runs, called directly
because the Forecast's projections are used one layer at a time, many backward passes
per step, which DDP's per-forward bucketing does not fit. After the sum every rank holds
the gradient of the one-process run with the same global batch, clips it and takes the
same AdamW step; the weights stay identical on every rank. Rank 0 writes checkpoints and
the final weights; ``--resume`` works with any number of ranks (the state holds the global
order). A Ctrl-C on any rank stops all of them after the step (a MAX all-reduce of the flag).
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
    """This process's place in a data-parallel run.

    Attributes: ``rank`` (0 .. ``world_size`` - 1), ``world_size``, ``device`` (``cuda:LOCAL_RANK``
    on CUDA, else the CPU).
    """

    rank: int
    world_size: int
    device: torch.device

    @classmethod
    def from_env(cls, device=None) -> "Distributed | None":
        """Join the process group that ``torchrun`` describes in the environment
        (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``); ``None`` when not
        launched by torchrun (one process).

        Args: device: ``cpu`` forces gloo on the CPU; otherwise CUDA (NCCL) when available.
        Raises SpardaError: ``--device cuda`` without CUDA, or fewer GPUs than local ranks.
        """
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
        """The positions in a global batch of ``global_batch`` sequences this rank trains on
        (contiguous, equal shares; ``global_batch`` is a multiple of ``world_size``)."""
        share = global_batch // self.world_size
        return range(self.rank * share, (self.rank + 1) * share)

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Give every rank rank 0's parameters (in place)."""
        for p in module.parameters():
            dist.broadcast(p.data, 0)

    def reduce(self, module: torch.nn.Module, totals: StepTotals) -> StepTotals:
        """Sum ``module``'s gradients over ranks in place (one flat all-reduce) and return
        the ``totals`` summed over ranks."""
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
        """Whether ``flag`` is set on any rank (every rank gets the same answer)."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def close(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()
