"""A custom op's call as it appears post-grad (direct, or inside auto_functionalized v1 / v2), read by
its schema's argument names: what the canonicalisation of other projects' ops (passes/canonicalize.py,
patterns/vllm_forms.py) reads their arguments and results through."""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from .graph import is_call

_AF = torch.ops.higher_order.auto_functionalized
_AF2 = getattr(torch.ops.higher_order, "auto_functionalized_v2", None)
# auto_functionalized_v2's keys for a mutated argument that is a view of its base
_VIEW_KEYS = ("_size", "_stride", "_storage_offset", "_slice_dim", "_slice_start", "_slice_end", "_alias")


class OpCall:
    """A call of a custom op as it appears post-grad: direct, or wrapped in auto_functionalized v1/v2.

    `arg(name)` gives the op's argument by schema name; `out(i)` the getitem nodes reading the
    op's i-th result; `new(name)` the getitem nodes reading the new value of mutated argument
    `name`. `ok` is False when the call cannot be read exactly (a mutated view, a non-getitem user)."""

    def __init__(self, n: Node):
        self.node, self.ok = n, True
        self.op = n.args[0] if n.target in (_AF, _AF2) else n.target
        schema = self.op._schema
        self.args: dict = {}
        if n.target is _AF:
            self.args = dict(n.kwargs)
        elif _AF2 is not None and n.target is _AF2:
            bases = n.kwargs.get("_all_bases", [])
            self.base_of: dict = {}
            for a in schema.arguments:
                if a.alias_info is not None and a.alias_info.is_write:
                    idx = n.kwargs.get(f"_{a.name}_base_index")
                    if any(f"_{a.name}{k}" in n.kwargs for k in _VIEW_KEYS):  # a view of its base: not read here
                        self.ok = False
                    self.args[a.name] = None if idx is None else bases[idx]
                    self.base_of[a.name] = idx
                elif a.name in n.kwargs:
                    self.args[a.name] = n.kwargs[a.name]
        else:
            for a, v in zip(schema.arguments, n.args):
                self.args[a.name] = v
            self.args.update(n.kwargs)
        for a in schema.arguments:  # defaults
            if a.name not in self.args and a.has_default_value():
                self.args[a.name] = a.default_value
        self.n_out = len(schema.returns)
        self.mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        self.items: dict[int, list[Node]] = {}
        for u in n.users:
            if is_call(u, operator.getitem) and isinstance(u.args[1], int):
                self.items.setdefault(u.args[1], []).append(u)
            else:
                self.ok = False

    def arg(self, name: str):
        return self.args.get(name)

    def out(self, i: int) -> list[Node]:
        return self.items.get(i, [])

    def new(self, name: str) -> list[Node]:
        if self.node.target not in (_AF, _AF2) or name not in self.mutated:
            return []
        first = max(1, self.n_out)  # auto_functionalized returns (op result(s)..., new values...)
        if self.node.target is _AF:
            return self.items.get(first + self.mutated.index(name), [])
        idx = self.base_of.get(name)
        return [] if idx is None else self.items.get(first + idx, [])
