"""fold_mla_output: the MLA attention's split combine and its value up-projection in one kernel.

Runs after lower_decode_gemm and fold_mla_prologue, over what they emitted. Matches, once per MLA
layer at decode (anchored on each auto-functionalized k3::mla_decode_normed):
    o = k3::mla_decode_normed(...)                        [M, H, L] (mutates kv_cache)
    y = k3::decode_bmm(views(o), W_uv, w_nk[, G])         views(o) == o.permute(1, 0, 2): [H, M, L]
(lower_decode_gemm's per-head bmm of `einsum("nhl,hvl->nhv", o, W_uv) * sigmoid(G)`).
Emits, in the same auto_functionalized node (so the cache update stays functionalised):
    y = k3::mla_decode_uv(..., W_uv, w_nk, G)             [H, M, V], stored token-major as decode_bmm's
whose CUDA path is the Triton split kernel, then one kernel per (token, head, 16 value columns) that
combines the splits' partials and multiplies by W_uv (and the gate): the attention output o never
goes to memory and the combine kernel's launch goes. Its reference is mla_decode_normed's followed by
decode_bmm's, so the rewritten graph equals the original exactly on CPU; on CUDA the new kernel
multiplies on the CUDA cores in fp32 where head_bmm used the tensor cores (fp32 accumulation both).
Near-miss: an MLA output read by anything else than one such bmm (the step where the chain
differs), views that are not that permute (checked by replaying them on an index tensor; a dynamic
M at its example value), a gate computed after the attention from values only the attention precedes.
Skipped: model dtype / TP size not supported, static M outside the pass's batch range; on CUDA with
Inductor, M outside its pipeline row's CUDA range (passes/pipeline.py). Prefill (mla_prefill) is left as it is.
"""
from __future__ import annotations

import operator

from torch.fx import Node
from torch.fx.node import map_aggregate

from ..ops import OPS
from ..patterns.graph import Fail, is_call, replays_to, shape
from ..patterns.structure import op_name
from .base import K3Pass
from .pipeline import register
from .common import retarget_functionalized
from .lower_decode_gemm import _CHAIN_OPS


_CORE = "k3::mla_decode_normed"


@register
class FoldMlaOutput(K3Pass):
    name = "fold_mla_output"
    core = "MLA"   # rewrites the reference model's MLA attention-core op: skipped (with a reason) without it
    description = "MLA split combine + value up-projection (+ output gate) -> k3::mla_decode_uv"
    pattern = "k3::decode_bmm(permute(o), W_uv, w_nk, G), o = mla_decode_normed(...) (per MLA decode layer)"
    emits = "k3::mla_decode_uv, in place of mla_decode_normed"

    def expected(self, info):
        return sum(op_name(n) == _CORE for n in info.attention)

    def run(self, graph, info, opts, report):
        order = {n: i for i, n in enumerate(graph.nodes)}
        cores = [n for n in info.attention if op_name(n) == _CORE]
        for af, out, bmm in self.collect(cores, lambda n: self.match(n, order), report):
            w, w_nk = bmm.args[1], bmm.args[2]
            gate = bmm.args[3] if len(bmm.args) > 3 else bmm.kwargs.get("gate")
            if gate is not None and order[gate] > order[af]:
                af.prepend(gate)          # a view of the gate input made right before the bmm (checked in match)
            retarget_functionalized(af, OPS["mla_decode_uv"], dict(af.kwargs, w_uv=w, w_nk=w_nk, gate=gate))
            y = bmm.meta.get("val")
            if isinstance(af.meta.get("val"), (tuple, list)) and y is not None:
                af.meta["val"] = (y, *af.meta["val"][1:])
            if y is not None:
                out.meta["val"] = y
            bmm.replace_all_uses_with(out)
            graph.erase_node(bmm)
            report.matched += 1

    @staticmethod
    def match(af, order):
        if not af.args or getattr(af.args[0], "_schema", None) is None:
            return Fail(af, "mla_decode_normed is not an auto-functionalized call (already reinplaced?)")
        outs = [u for u in af.users if is_call(u, operator.getitem) and u.args[1] == 0]
        if len(outs) != 1:
            return Fail(af, "the attention output is not read once")
        out = outs[0]
        chain, n = [], out
        while len(n.users) == 1 and is_call(next(iter(n.users)), *_CHAIN_OPS):
            n = next(iter(n.users))
            chain.append(n)
        users = list(n.users)
        if len(users) != 1 or not is_call(users[0], OPS["decode_bmm"]) or users[0].args[0] is not n:
            return Fail(n, "the attention output is not read by one per-head bmm (k3::decode_bmm) alone")
        bmm = users[0]
        mhl = shape(out)
        if mhl is None or not replays_to(chain, mhl, lambda t: t.permute(1, 0, 2)):
            return Fail(bmm, "the bmm's input is not the attention output permuted to [H, M, L]")
        gate = bmm.args[3] if len(bmm.args) > 3 else bmm.kwargs.get("gate")
        if gate is not None and order[gate] > order[af]:
            flat = []
            map_aggregate((gate.args, gate.kwargs), lambda a: flat.append(a) if isinstance(a, Node) else None)
            if not is_call(gate, *_CHAIN_OPS) or any(order[a] > order[af] for a in flat):
                return Fail(gate, "the output gate is computed after the attention")
        return af, out, bmm
