"""The table of GPU kernels behind the `k3::` ops.

A kernel registers itself for (op name, device type) with a predicate on the call (e.g. an M
range or a dtype); the families register theirs beside their launchers (`comm`, `gemm`, `moe`,
`attention`). `dispatch.pick` asks the table; this module imports nothing of the families.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

_KERNELS: dict[tuple[str, str], list["Kernel"]] = {}


@dataclass
class Kernel:
    name: str
    fn: Callable
    accepts: Callable[..., bool]


def register(op: str, device: str, name: str, accepts: Callable[..., bool] | None = None):
    def deco(fn):
        _KERNELS.setdefault((op, device), []).append(Kernel(name, fn, accepts or (lambda *a, **k: True)))
        return fn
    return deco


def kernels(op: str, device: str) -> list[Kernel]:
    """The kernels registered for (op, device), in registration order."""
    return _KERNELS.get((op, device), [])


def registered(op: str | None = None) -> dict[tuple[str, str], list[str]]:
    return {key: [k.name for k in ks] for key, ks in _KERNELS.items() if op is None or key[0] == op}
