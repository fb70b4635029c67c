"""shard_router_latent: replicated router + latent projection -> one TP-sharded GEMM + all-gather.

Matches, once per MoE layer (anchored on the router's top-k, found by role: patterns.roles; the
latent GEMM is the GEMM on the router's input that the experts' results depend on; one GEMM over
both weights, split into [logits, latent], matches too):
    logits = x @ W_r.T      # [N, E], replicated weight (E = number of experts)
    lat    = x @ W_down.T   # [N, L], replicated weight, the expert op's input
In vLLM's Kimi K3 the MoE is its opaque op (found by role, patterns.roles), anchored on its arguments:
    vllm::moe_forward_shared(hidden_states=lat, router_logits=logits, shared_experts_input=x, ...)
with GateLinear's fp32 logits: the GEMM in the model dtype cast up (vLLM's fallback, CPU), or
`mm(x, W_r.T, out_dtype=float32)` (its cuBLAS tier; then the op's router_fp32).
Emits:
    logits, lat = k3::router_latent_sharded(x, W_r, W_down, rank, tp, group)
    (an fp32 router, x.float() @ W_r.float().T, keeps its fp32 logits: the op's router_fp32 argument;
    the CUDA kernels compute bf16 logits, so that call runs the op's reference: the rank's router rows
    in fp32, the gather in fp32)
At TP > 1 rank r multiplies by rows [r*s, (r+1)*s) of [W_r; W_down], s = (E + L) / tp, in one GEMM,
then one all-gather; the one rank whose rows straddle both weights runs the GEMM over its rows of
each weight in one launch (kernels/gemm.mma_gemm2) where the tuned config's tile divides its router rows
(TP=2: 896 of 2240), else keeps a copy of them, s x hidden, made on its first call: 8 MB per MoE
layer at TP=8 (kernels/comm.rank_rows).
At TP = 1 nothing is sharded or gathered: the op is the two GEMMs in ONE launch of the decode GEMM
over the stacked rows of both weights (gemm.mma_gemm2; no copy of either weight), where the tuned
table has the stacked shape and M, else each GEMM as lower_decode_gemm would run it. (Two GEMMs of
one input, the router's 896 rows alone filling a part of the SMs: 7.0 us for 2.9 us of bytes.)
The router's selection on those logits is the next pass's (fuse_router_topk).
Skipped: model dtype not in options.dtypes, TP size not in options.tp_sizes, static M outside the
pass's batch range. On CUDA with Inductor, M outside its pipeline row's CUDA range (passes/pipeline.py) (the
profitability gate, base.gated_off; the reason is in the report). Near-miss: (E + L) not divisible
by TP, router and latent weights of different dtypes, no router GEMM on the same input; for vLLM's op,
router logits or a latent that are no GEMM of its shared experts' input (GateLinear's CuTe tiers on
SM90+ at M <= 16/32 run outside any graph-visible GEMM: such a router is a near-miss naming it).
"""
from __future__ import annotations

from ..ops import OPS
import collections
import dataclasses
import operator

import torch

from torch.fx import Node

from ..patterns.graph import (CONVERT_OPS, VIEW_OPS, Fail, LinearSite, aten, describe, dtype, is_call, is_weight_like,
                              match_linear, shape, strip, val, weight_of, weight_out_in)
from ..patterns.roles import op_name
from ..patterns.vllm_forms import moe_op_args
from ..patterns.moe import finalize, selection, topk_weights
from ..patterns.roles import ResidualAdd
from .base import K3Pass
from .pipeline import register
from .common import emit, getitem, last_of, replace


@register
class ShardRouterLatent(K3Pass):
    name = "shard_router_latent"
    description = ("replicated router + latent down-projection -> k3::router_latent_sharded (GEMM on 1/TP rows "
                   "+ all-gather; at TP=1 one GEMM over both weights)")
    pattern = "mm(x, W_r.T) and mm(x, W_down.T) on the same x, replicated weights (per MoE layer)"
    emits = "k3::router_latent_sharded"

    def expected(self, info):
        return info.n_moe

    def run(self, graph, info, opts, report):
        anchors = info.moe if info.by_role else info.experts
        for router, latent, *fp32 in self.collect(anchors, lambda e: self.match(e, info), report):
            if isinstance(router, tuple):   # one GEMM over [W_r; W_down], split: its rows
                self.rewrite_split(graph, router, latent, info)
                report.matched += 1
                continue
            wr = weight_out_in(graph, router, last_of(graph, [router.out, latent.out]))
            wd = weight_out_in(graph, latent, last_of(graph, [router.out, latent.out]))
            anchor = last_of(graph, [router.x, wr, wd])
            flag = (True,) if fp32 and fp32[0] else ()
            op = emit(graph, anchor, OPS["router_latent_sharded"],
                      (router.x, wr, wd, info.rank, info.tp, info.group, *flag))
            lat = getitem(graph, op, 1)
            logits = getitem(graph, op, 0)
            replace(graph, router.out, logits)
            replace(graph, latent.out, lat)
            report.matched += 1

    def rewrite_split(self, graph, split, lin, info):
        """logits, lat = split(x @ W.T, [E, L]): the op over W's first E rows and the rest."""
        logits, lat, e = split
        w = weight_out_in(graph, lin, lin.out)
        with graph.inserting_before(lin.out):
            wr = graph.call_function(aten.slice.Tensor, (w, 0, 0, e))
            wd = graph.call_function(aten.slice.Tensor, (w, 0, e, shape(w)[0]))
        for t, a, b in ((wr, 0, e), (wd, e, shape(w)[0])):
            t.meta["val"] = val(w)[a:b]
        op = emit(graph, last_of(graph, [lin.x, wr, wd]), OPS["router_latent_sharded"],
                  (lin.x, wr, wd, info.rank, info.tp, info.group))
        replace(graph, logits, getitem(graph, op, 0))
        replace(graph, lat, getitem(graph, op, 1))

    def match(self, e, info):
        if isinstance(e, ResidualAdd):
            return self.match_role(e, info)
        lat = e.args[0]
        latent = match_linear(lat)
        if isinstance(latent, Fail):
            return Fail(lat, f"expert input is not a latent projection ({latent.reason})")
        if latent.residual is not None or latent.bias is not None or not is_weight_like(latent.w):
            return Fail(lat, "latent projection has a bias/residual or a computed weight")
        n_exp = shape(e.args[2])[0] if shape(e.args[2]) else None
        x = latent.x
        routers = [u for u in x.users if u is not latent.out and is_call(u, aten.mm.default)
                   and shape(u) is not None and shape(u)[-1] == n_exp]
        if len(routers) != 1:
            return Fail(x, f"expected one router GEMM ({n_exp} outputs) on the expert layer's input, "
                           f"found {len(routers)}")
        router = match_linear(routers[0])
        if isinstance(router, Fail) or not is_weight_like(router.w):
            return Fail(routers[0], "router GEMM has a computed weight")
        if dtype(router.w) != dtype(latent.w):
            return Fail(routers[0], f"router weight dtype {dtype(router.w)} != latent weight dtype {dtype(latent.w)}: "
                                    "one GEMM needs one dtype")
        total = n_exp + shape(lat)[-1]
        if total % info.tp:
            return Fail(lat, f"experts + latent = {total} rows do not split evenly over TP={info.tp}")
        return router, latent

    def match_role(self, r, info):
        """A MoE found by role: the router GEMM under its selection's logits, and the latent GEMM on
        the same input that the experts' results depend on."""
        if r.op is not None:
            return self.match_op(r, info)
        logits = _logits(r.topk)
        if isinstance(logits, Fail):
            return logits
        n_exp = shape(logits)[-1] if shape(logits) else None
        src = strip(logits)
        if is_call(src, operator.getitem) and is_call(src.args[0], aten.split.Tensor, aten.split_with_sizes.default):
            sp = src.args[0]
            lin = match_linear(sp.args[0])
            sizes = sp.args[1] if isinstance(sp.args[1], (list, tuple)) else None
            outs = {u.args[1]: u for u in sp.users if is_call(u, operator.getitem)}
            if (isinstance(lin, Fail) or not is_weight_like(lin.w) or lin.bias is not None or lin.residual is not None
                    or src.args[1] != 0 or set(outs) != {0, 1} or (sizes is not None and len(sizes) != 2)):
                return Fail(src, "the router logits are a split of something other than one GEMM into [logits, latent]")
            if dtype(lin.x) != info.dtype:
                return Fail(lin.out, f"the router GEMM runs in {dtype(lin.x)}: the sharded op computes in {info.dtype}")
            total = shape(lin.out)[-1]
            if total % info.tp:
                return Fail(lin.out, f"experts + latent = {total} rows do not split evenly over TP={info.tp}")
            return (outs[0], outs[1], n_exp), lin
        router = match_linear(logits)
        if isinstance(router, Fail):
            return Fail(logits, f"the router logits are not a GEMM ({router.reason})")
        if not is_weight_like(router.w) or router.bias is not None or router.residual is not None:
            return Fail(logits, "the router GEMM has a bias or a computed weight")
        fp32 = dtype(router.x) != info.dtype
        if fp32:   # x.float() @ W_r.float().T: the op's fp32 logits from the uncast input and weight
            x16 = _uncast(router.x, info.dtype)
            if dtype(router.x) != torch.float32 or x16 is None or dtype(strip(router.w, converts=True)) not in (
                    info.dtype, torch.float32):
                return Fail(logits, f"the router GEMM runs in {dtype(router.x)} on an input that is not a "
                                    f"{info.dtype} tensor cast up: the sharded op takes a {info.dtype} input")
            router = dataclasses.replace(router, x=x16, w=strip(router.w, converts=True))
        x = strip(router.x, converts=True)
        y = _expert_results(r)
        lats = [u for u in _readers(x) if u is not strip(logits) and is_call(u, aten.mm.default)
                and y is not None and _depends(y, u)]
        if len(lats) != 1:
            return Fail(x, f"expected one latent GEMM on the router's input feeding the experts, found {len(lats)}")
        latent = match_linear(lats[0])
        if isinstance(latent, Fail) or not is_weight_like(latent.w) or latent.bias is not None:
            return Fail(lats[0], "the latent projection has a bias or a computed weight")
        if dtype(router.w) != dtype(latent.w) and not fp32:
            return Fail(lats[0], f"router weight dtype {dtype(router.w)} != latent weight dtype {dtype(latent.w)}: "
                                 "one GEMM needs one dtype")
        total = n_exp + shape(lats[0])[-1]
        if total % info.tp:
            return Fail(lats[0], f"experts + latent = {total} rows do not split evenly over TP={info.tp}")
        return router, latent, fp32


    def match_op(self, r, info):
        """vLLM's opaque MoE op (`r.op`): its `router_logits` argument is the router GEMM of its
        `shared_experts_input` x (GateLinear's fp32 logits: the GEMM in the model dtype cast up, as on
        CPU, or `torch.mm(x, W_r.T, out_dtype=float32)`, cuBLAS's tier on Hopper), its `hidden_states`
        the latent down-projection of x."""
        a = moe_op_args(r.op)
        logits, lat, x = a.get("router_logits"), a.get("hidden_states"), a.get("shared_experts_input")
        if not all(isinstance(t, Node) for t in (logits, lat, x)):
            return Fail(r.op, f"{op_name(r.op)} is not given router logits, a latent and the shared experts' input")
        src = strip(logits, converts=True)
        if is_call(src, aten.mm.dtype):   # bf16 x bf16 -> fp32 in one GEMM: the op's fp32 logits
            w, layout = weight_of(src.args[1])
            router, fp32 = LinearSite(out=src, x=src.args[0], w=w, w_layout=layout, nodes=[src]), True
        else:
            router = match_linear(src)
            if isinstance(router, Fail):
                return Fail(logits, f"the router logits {op_name(r.op)} takes are not a GEMM ({router.reason})")
            fp32 = dtype(router.x) != info.dtype
        if not is_weight_like(router.w) or router.bias is not None or router.residual is not None:
            return Fail(src, "the router GEMM has a bias or a computed weight")
        if fp32 and router.out.target is not aten.mm.dtype:   # x.float() @ W_r.float().T (GateLinear's fallback)
            x16 = _uncast(router.x, info.dtype)
            if x16 is None:
                return Fail(src, f"the router GEMM runs in {dtype(router.x)} on an input that is not a "
                                 f"{info.dtype} tensor cast up: the sharded op takes a {info.dtype} input")
            router = dataclasses.replace(router, x=x16, w=strip(router.w, converts=True))
        xs = strip(x, converts=True)
        if strip(router.x, converts=True) is not xs:
            return Fail(src, f"the router GEMM reads {describe(router.x)}, not the MoE input {describe(x)} "
                             f"that {op_name(r.op)} gives its shared experts")
        latent = match_linear(lat)
        if isinstance(latent, Fail):
            return Fail(lat, f"the routed input of {op_name(r.op)} is not a latent GEMM ({latent.reason})")
        if not is_weight_like(latent.w) or latent.bias is not None or latent.residual is not None:
            return Fail(lat, "the latent projection has a bias or a computed weight")
        if strip(latent.x, converts=True) is not xs:
            return Fail(lat, f"the latent GEMM reads {describe(latent.x)}, not the router's input {describe(x)}")
        if dtype(strip(router.w, converts=True)) != dtype(latent.w) and not fp32:
            return Fail(lat, f"router weight dtype {dtype(router.w)} != latent weight dtype {dtype(latent.w)}: "
                             "one GEMM needs one dtype")
        total = shape(router.out)[-1] + shape(lat)[-1]
        if total % info.tp:
            return Fail(lat, f"experts + latent = {total} rows do not split evenly over TP={info.tp}")
        return router, latent, fp32


def _logits(topk):
    if is_call(topk, aten.topk.default):
        s = selection(topk)
        return s if isinstance(s, Fail) else s.logits
    return topk.args[0]   # k3::router_topk(logits, ...)


def _uncast(n, dt):
    """The tensor of dtype dt that n is a chain of casts (and views) of, nearest first; else None."""
    while is_call(n, *CONVERT_OPS, *VIEW_OPS):
        n = n.args[0]
        if dtype(n) == dt:
            return n
    return None


def _readers(x):
    """The nodes that read x, through views and casts."""
    out, stack = [], [x]
    while stack:
        for u in stack.pop().users:
            if is_call(u, *VIEW_OPS, *CONVERT_OPS):
                stack.append(u)
            else:
                out.append(u)
    return out


def _expert_results(r):
    w = topk_weights(r.topk)
    f = finalize(w) if not isinstance(w, Fail) else w
    return None if isinstance(f, Fail) else f[0]


def _depends(y, n, limit: int = 2000) -> bool:
    """y depends on n (a bounded breadth-first walk back from y: the latent GEMM is a few steps away)."""
    seen, queue = {y}, collections.deque([y])
    while queue and len(seen) < limit:
        m = queue.popleft()
        if m is n:
            return True
        for a in m.all_input_nodes:
            if a not in seen:
                seen.add(a)
                queue.append(a)
    return False
