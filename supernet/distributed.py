"""Data parallelism for supernet training under torchrun (gloo on CPU, nccl on GPU).

Every rank samples the same subnets per step (they derive from the step number) and processes
its own sequences; gradients are averaged with one all-reduce per parameter before the
optimizer step. This is DistributedDataParallel's arithmetic written out: the sandwich rule runs
several forward/backward passes per step over different subsets of the weights, which DDP's
bucketed hooks handle poorly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> Dist:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); a no-op otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def average_gradients(params: list[torch.nn.Parameter], d: Dist) -> None:
    if d.world <= 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= d.world


def barrier(d: Dist) -> None:
    if d.world > 1:
        dist.barrier()


def shutdown(d: Dist) -> None:
    if d.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
