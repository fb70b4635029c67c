"""Tensor parallelism for the reference model, through torch.distributed functional collectives.

Functional collectives (`torch.distributed._functional_collectives`) trace into the FX graph as
`_c10d_functional.all_reduce` / `all_gather_into_tensor` + `wait_tensor`, so the same model code
runs on gloo (CPU) and NCCL (GPU), eagerly and under torch.compile.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    group_name: str | None = None  # None when size == 1

    @classmethod
    def current(cls, tp: int | None = None) -> "TPInfo":
        """TP over the default process group (all ranks), or single-rank when none is initialised."""
        if not (dist.is_available() and dist.is_initialized()):
            if tp not in (None, 1):
                raise ValueError(f"TP size {tp} requested but torch.distributed is not initialised")
            return cls()
        world = dist.get_world_size()
        if tp is not None and tp != world:
            raise ValueError(f"TP size {tp} != world size {world}; the reference model uses the whole world as its TP group")
        if world == 1:
            return cls()
        return cls(rank=dist.get_rank(), size=world, group_name=dist.group.WORLD.group_name)

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous 1/size slice of `t` along `dim`."""
        if self.size == 1:
            return t
        n = t.shape[dim]
        assert n % self.size == 0, (n, self.size)
        step = n // self.size
        return t.narrow(dim, self.rank * step, step).contiguous()


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    if tp.size == 1:
        return x
    return funcol.all_reduce(x, "sum", tp.group_name)


def all_gather(x: torch.Tensor, tp: TPInfo, dim: int = 0) -> torch.Tensor:
    if tp.size == 1:
        return x
    return funcol.all_gather_tensor(x, dim, tp.group_name)
