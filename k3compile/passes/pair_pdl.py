"""pair_pdl: the TP=1 norm op and the decode GEMM that reads its output, paired for Programmatic Dependent Launch.

Runs last, over the ops the other passes emitted. The layer-input and post-attention norm kernel at TP=1
is one program per row that reads almost nothing, and the GEMM after it cannot start streaming its weight
until it ends; with PDL the GEMM launches at the norm's start and streams meanwhile. Whether the two are a
pair is a fact of the graph, so this pass decides it and passes it to both ops as arguments.
Matches, once per norm op at TP=1 (group None) with a normed output:
    updated, normed = k3::residual_norm(..., group=None, ...)   (or k3::oproj_allreduce_residual with g)
    y = k3::decode_gemm(views(normed), W)                       (or k3::router_latent_sharded(normed, ...))
where the GEMM op is the first op after the norm (graph order) whose CUDA path launches a decode GEMM or
another norm kernel on the layer's stream (_NEXT: also the o-proj op's own GEMM and the latent tail's
up-projection), and reads the normed output itself or through views only (no copy).
Emits the same two calls with `trigger=True` on the norm and `after_trigger=True` on the GEMM. On CUDA the
norm kernel then triggers its dependents at its start (kernels/comm.ar_residual_norm, TRIGGER) and a
CUDA-core GEMV is launched with PDL, its weight rows' first bytes requested into L2 before it waits,
where K3_KNOBS gemv_pdl and tuning.GEMV_PDL_PF say so for its shape (kernels/gemm.gemv_pdl, read at
launch: off, or an MMA config, launches it as before).
Reference: unchanged (both arguments are launch hints the references ignore): exact on CPU.
Correct whatever runs between the two on the GPU: PDL lets the GEMV start before the kernel right
before it in the stream has finished, and the GEMV reads x (and, accumulating, its output) only after
griddepcontrol.wait, which returns once that kernel has completed and its writes are visible; before
it, only weights (kernels/triton_gemv.gemv_kernel). If that kernel is not the triggering norm (Inductor
scheduled one between, or the norm op ran its reference or a form that does not trigger), the GEMV
launches when it ends, as without PDL, only slower (5.44 against 4.77 us measured for the MLA q_b
after Inductor's norm, tuning.GEMV_PDL_PF).
Expected: every norm op at TP=1 with a normed output that a decode GEMM op reads (counted when the
pass runs, from the ops the earlier passes emitted).
Near-miss, not counted: another of those ops runs between the norm and the GEMM reading its output.
At TP > 1 no norm op is in its TP=1 form (only the TP=1 kernel triggers; the one-shot all-reduce
kernel waits for its peers first): no site, a note says so.
Skipped: model dtype / TP size not supported, static M outside [1, 16] (the decode GEMM's), without
lower_decode_gemm (`needs`); on CUDA with Inductor, M outside its pipeline row's CUDA range
(passes/pipeline.py: M=1, where the GEMVs run).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from ..ops import OPS
from ..patterns.graph import NoSite, is_call
from ..patterns.opcall import OpCall
from ..patterns.structure import op_name
from .base import K3Pass
from .pipeline import register

aten = torch.ops.aten

_NORMS = (OPS["residual_norm"], OPS["oproj_allreduce_residual"])
_GEMMS = (OPS["decode_gemm"], OPS["router_latent_sharded"])
# the ops whose CUDA path launches a decode GEMM or a norm kernel on the layer's stream: the first of
# them after a norm is the one its trigger is for
_NEXT = _NORMS + _GEMMS + (OPS["moe_latent_tail"],)
# views that copy nothing (the GEMM reads the norm kernel's output memory)
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dim, aten.squeeze.dims,
          aten.squeeze.default, aten.unsqueeze.default, aten.alias.default, aten.select.int, aten.slice.Tensor}


def set_arg(node: Node, name: str, value) -> None:
    """Set argument `name` of a call of a custom op: in place where it is given by position, else as a keyword."""
    idx = [a.name for a in node.target._schema.arguments].index(name)
    if len(node.args) > idx:
        node.args = (*node.args[:idx], value, *node.args[idx + 1:])
    else:
        node.kwargs = {**node.kwargs, name: value}


def normed_readers(norm: Node) -> list[Node]:
    """The GEMM ops whose x is the norm op's normed output (its result 1), directly or through views."""
    out, todo = [], [u for u in norm.users if is_call(u, operator.getitem) and u.args[1] == 1]
    while todo:
        n = todo.pop()
        for u in n.users:
            if is_call(u, *_VIEWS) and u.args[0] is n:
                todo.append(u)
            elif is_call(u, *_GEMMS) and OpCall(u).arg("x") is n:
                out.append(u)
    return out


def next_launch(norm: Node) -> Node | None:
    """The first op of _NEXT after `norm` in graph order."""
    n = norm.next
    while n.op != "root" and not is_call(n, *_NEXT):
        n = n.next
    return None if n.op == "root" else n


@register
class PairPdl(K3Pass):
    name = "pair_pdl"
    description = ("TP=1 norm op + the decode GEMM reading its output -> the norm's trigger and the GEMM's "
                   "after_trigger (the GEMV as the norm kernel's PDL secondary)")
    pattern = ("k3::residual_norm / k3::oproj_allreduce_residual (group None, with a norm), then as the next GEMM "
               "op k3::decode_gemm / k3::router_latent_sharded of its normed output")
    emits = "trigger=True on the norm op, after_trigger=True on the GEMM op"

    def expected(self, info):
        # the norm and GEMM ops are the earlier passes' (their sites depend on which ran): run() counts them
        return 0

    def run(self, graph, info, opts, report):
        norms = [n for n in graph.nodes if is_call(n, *_NORMS)]
        tp1 = [n for n in norms if OpCall(n).arg("group") is None and OpCall(n).arg("g") is not None]
        cands = [n for n in tp1 if normed_readers(n)]
        report.expected = len(cands)
        if norms and not tp1:
            report.notes.append(f"no norm op in its TP=1 form (TP={info.tp}): only the TP=1 norm kernel triggers "
                                "its dependents, no GEMM is paired")
        elif len(cands) < len(tp1):
            report.notes.append(f"{len(tp1) - len(cands)} TP=1 norm op(s) whose output no decode GEMM op reads: "
                                "not paired")
        for norm, gemm in self.collect(cands, self.match, report):
            set_arg(norm, "trigger", True)
            set_arg(gemm, "after_trigger", True)
            report.matched += 1
        if report.matched:
            report.notes.append(f"{report.matched} norm -> GEMM pair(s): on CUDA the GEMV launches as the norm "
                                "kernel's PDL secondary where K3_KNOBS gemv_pdl and tuning.GEMV_PDL_PF say so "
                                "(read at launch)")

    @staticmethod
    def match(norm):
        readers = normed_readers(norm)
        nxt = next_launch(norm)
        if nxt in readers:
            return norm, nxt
        return NoSite(nxt, f"{op_name(nxt)} runs between the norm and the GEMM reading its output "
                           f"({readers[0].name}): the norm triggers only the GEMM launched right after it")
