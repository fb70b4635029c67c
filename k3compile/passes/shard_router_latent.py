"""shard_router_latent: replicated router + latent projection -> one TP-sharded GEMM + all-gather.

Matches, once per MoE layer (anchored on each routed-expert op):
    logits = x @ W_r.T      # [N, E], replicated weight (E = number of experts)
    lat    = x @ W_down.T   # [N, L], replicated weight, the expert op's input
Emits:
    logits, lat = k3::router_latent_sharded(x, W_r, W_down, rank, tp, group)
At TP > 1 rank r multiplies by rows [r*s, (r+1)*s) of [W_r; W_down], s = (E + L) / tp, in one GEMM,
then one all-gather; the one rank whose rows straddle both weights runs the GEMM over its rows of
each weight in one launch (launch.mma_gemm2) where the tuned config's tile divides its router rows
(TP=2: 896 of 2240), else keeps a copy of them, s x hidden, made on its first call: 8 MB per MoE
layer at TP=8 (kernels/launch.rank_rows).
At TP = 1 nothing is sharded or gathered: the op is the two GEMMs in ONE launch of the decode GEMM
over the stacked rows of both weights (launch.mma_gemm2; no copy of either weight), where the tuned
table has the stacked shape and M, else each GEMM as lower_decode_gemm would run it. (Two GEMMs of
one input, the router's 896 rows alone filling a part of the SMs: 7.0 us for 2.9 us of bytes.)
The router's selection on those logits is the next pass's (fuse_router_topk).
Skipped: model dtype not in options.dtypes, TP size not in options.tp_sizes, static M outside the
pass's batch range. On CUDA with Inductor, M outside its options.CUDA_PROFITABLE_M range (the
profitability gate, base.gated_off; the reason is in the report). Near-miss: (E + L) not divisible
by TP, router and latent weights of different dtypes, no router GEMM on the same input.
"""
from __future__ import annotations

from ..ops import OPS
from ..patterns.graph import Fail, aten, dtype, is_call, is_weight_like, match_linear, shape, weight_out_in
from .base import K3Pass
from .common import emit, getitem, last_of, replace


class ShardRouterLatent(K3Pass):
    name = "shard_router_latent"
    description = ("replicated router + latent down-projection -> k3::router_latent_sharded (GEMM on 1/TP rows "
                   "+ all-gather; at TP=1 one GEMM over both weights)")
    pattern = "mm(x, W_r.T) and mm(x, W_down.T) on the same x, replicated weights (per MoE layer)"
    emits = "k3::router_latent_sharded"

    def expected(self, info):
        return len(info.experts)

    def run(self, graph, info, opts, report):
        for router, latent in self.collect(info.experts, lambda e: self.match(e, info), report):
            wr = weight_out_in(graph, router, last_of(graph, [router.out, latent.out]))
            wd = weight_out_in(graph, latent, last_of(graph, [router.out, latent.out]))
            anchor = last_of(graph, [router.x, wr, wd])
            op = emit(graph, anchor, OPS["router_latent_sharded"], (router.x, wr, wd, info.rank, info.tp, info.group))
            lat = getitem(graph, op, 1)
            logits = getitem(graph, op, 0)
            replace(graph, router.out, logits)
            replace(graph, latent.out, lat)
            report.matched += 1

    def match(self, e, info):
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
