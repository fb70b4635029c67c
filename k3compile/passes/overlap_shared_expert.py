"""overlap_shared_expert: shared expert on a side stream; L2 prefetch during communication.

Matches, once per MoE layer (anchored on the router's top-k, found by role: patterns.roles; the MoE
input is the router GEMM's input, the routed work the join waits for is the experts' results):
    s = SiTU(x @ W_gate_up.T) @ W_down.T      # x: the MoE input (the routed experts' router input)
    s = SiTU(x @ W_gate.T, x @ W_up.T) @ W_down.T   # or two GEMMs (the gate is the one under the sigmoid)
Emits:
    h = k3::shared_expert_async(x, W_gate_up, W_down, beta, linear_beta, logits)   # (..., logits, W_up): two
    ids, w = k3::router_topk(logits, ..., after=h)   # the fused selection, when fuse_router_topk fired
    s = k3::stream_join(h, y_routed)        # right before s's first user, after the routed experts
The fork is pinned between the router GEMM and its top-k by two ordering-only arguments (neither
kernel reads them): the fork takes the logits, the top-k takes the fork's output. So the side stream
always starts beside the one-CTA top-k and the routed experts, never beside the router GEMM, whatever
order Inductor's scheduler (reorder_for_peak_memory) would pick. Without a k3::router_topk (its pass
gated off), or with options.pin_shared_fork off, the fork goes right after x, unpinned.
Where s's only user is k3::moe_latent_tail, that op takes h and joins the side stream itself: no
stream_join, no copy of s. History (bench/results, BENCHMARKS.md): forking after the router's selection,
beside the routed experts only, measured slower (KDA / MLA at M=1 138.5 / 151.2 us against 133.6 /
138.0); with the fork unpinned, Inductor put it beside the top-k in the KDA layer (good) but
beside the router + latent GEMM in the MLA layer (+4.1 us on that GEMM), and a fork merely
placed after the GEMM in the graph was launched after the top-k. Hence the pin.
Then, at TP > 1 and with options.prefetch, gives every communication op the weights the graph
reads right after it (up to options.prefetch_bytes): the `prefetch` list of each fused op, and
plain `all_reduce`s become `k3::all_reduce_prefetch(x, group, weights)`. Prefetch is data
flow, not a side-effect op, so no scheduler can drop or reorder it away from its all-reduce.
On CPU both are ordering no-ops (the reference runs the shared expert in line).
Not counted as expected: a MoE in vLLM's opaque MoE op, which runs the shared expert inside it
(vllm::moe_forward_shared, given the MoE input as shared_experts_input): a near-miss naming the op.
Skipped: model dtype not in options.dtypes, TP size not in options.tp_sizes, static M outside
the pass's batch range; on CUDA with Inductor, M outside its pipeline row's CUDA range (passes/pipeline.py) (the
profitability gate, base.gated_off). The prefetch has its own gate entry, "prefetch", which is
empty: the per-layer benchmark measured it slower at every M, so by default it is not placed (a
note in the report says why); gate="off" with options.prefetch places it.
"""
from __future__ import annotations

import operator

import torch

from ..ops import OPS
from ..patterns.graph import (Fail, NoSite, aten, c10d, describe, dtype, is_call, is_weight_like, match_all_reduce,
                              match_linear, scalar, shape, strip, val, weight_out_in)
from ..patterns.moe import finalize, selection
from ..patterns.roles import ResidualAdd
from ..patterns.roles import op_name
from ..patterns.vllm_forms import count_vllm_fused_allreduces, inside_moe_op
from .base import K3Pass, gated_off
from .pipeline import register
from .common import emit, forward_gemm, last_of, replace, users_through_views

_ELEMENTWISE = {
    aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, operator.getitem, aten.div.Tensor,
    aten.mul.Tensor, aten.tanh.default, aten.sigmoid.default, torch.ops.prims.convert_element_type.default,
    aten.view.default, aten.reshape.default,
}


@register
class OverlapSharedExpert(K3Pass):
    name = "overlap_shared_expert"
    description = "shared expert -> side stream (k3::shared_expert_async + k3::stream_join); L2 prefetch during all-reduces"
    pattern = "mm(x, W_gu.T) -> SiTU -> mm(W_down.T) on the MoE input (per MoE layer); every all-reduce at TP > 1"
    emits = "k3::shared_expert_async, k3::stream_join, k3::all_reduce_prefetch"

    def expected(self, info):
        return info.n_moe

    def run(self, graph, info, opts, report):
        pinned = 0
        # the known expert ops where every MoE has one (their latent input leads to the MoE input), else
        # the MoEs found by role (the router's input)
        anchors = info.experts if len(info.experts) >= len(info.moe) else info.moe
        for s in self.collect(anchors, self.match, report):
            gu = weight_out_in(graph, s["up"], s["up"].out)
            dn = weight_out_in(graph, s["down"], s["up"].out)
            wu = [weight_out_in(graph, s["up2"], s["up"].out)] if s["up2"] is not None else []   # separate up weight
            tk = (s["topk"] if "topk" in s else _router_topk_of(s["expert"])) if opts.pin_shared_fork else None
            if tk is None:
                anchor = last_of(graph, [s["x"], gu, dn, *wu])
                h = emit(graph, anchor, OPS["shared_expert_async"],
                         (s["x"], gu, dn, s["beta"], s["lbeta"], *((None, *wu) if wu else ())))
            else:   # pinned: router GEMM -> fork -> top-k (ordering-only arguments on both ops)
                logits = tk.args[0]
                anchor = last_of(graph, [s["x"], gu, dn, logits, *wu])
                h = emit(graph, anchor, OPS["shared_expert_async"], (s["x"], gu, dn, s["beta"], s["lbeta"], logits, *wu))
                order = _order(graph)
                if order[h] > order[tk]:
                    raise RuntimeError(f"the shared expert's fork lands after the router top-k {tk.name}")
                tk.kwargs = {**tk.kwargs, "after": h}
                pinned += 1
            order = _order(graph)
            first_user = min(s["down"].out.users, key=lambda u: order[u])
            after = s["expert"]
            if order[after] > order[first_user]:
                raise RuntimeError(f"{first_user.name} reads the shared expert before the routed experts run")
            out = s["down"].out
            if (len(out.users) == 1 and is_call(first_user, OPS["moe_latent_tail"]) and first_user.args[2] is out
                    and out not in (*first_user.args[:2], *first_user.args[3:]) and dtype(out) == dtype(h)):
                # the latent tail joins the side stream itself (ops/fused.moe_latent_tail): no join op,
                # and no copy of the partial (a custom op's output may not alias its input)
                first_user.replace_input_with(out, h)
            else:
                j = emit(graph, first_user.prev, OPS["stream_join"], (h, after))
                replace(graph, out, j)
            report.matched += 1
        if report.matched:
            report.notes.append(f"side-stream fork pinned between the router GEMM and its top-k at {pinned} of "
                                f"{report.matched} sites" + ("" if opts.pin_shared_fork else " (pin_shared_fork off)"))
        gated = gated_off("prefetch", info, opts) if info.tp > 1 and opts.prefetch else None
        if gated:
            report.notes.append(f"L2 prefetch {gated}")
        elif info.tp > 1 and opts.prefetch:
            n = self.place_prefetch(graph, opts.prefetch_bytes)
            report.notes.append(f"L2 prefetch attached to {n} communication ops")
            k = count_vllm_fused_allreduces(graph)
            if k:
                report.notes.append(f"{k} all-reduce(s) already fused by vLLM (FlashInfer/AITER) get no L2 prefetch")

    def match(self, e):
        if isinstance(e, ResidualAdd):
            return self.match_role(e)
        lat = e.args[0]
        if is_call(lat, operator.getitem) and is_call(lat.args[0], OPS["router_latent_sharded"]):
            x = lat.args[0].args[0]
        else:
            lin = match_linear(lat)
            if isinstance(lin, Fail):
                return Fail(lat, f"cannot find the MoE input ({lin.reason})")
            x = lin.x
        return self.match_shared(x, {lat}, e)

    def match_role(self, r):
        """A MoE found by role: the MoE input is the router GEMM's input; the routed work to wait for
        is the experts' results (the finalize's input, or the latent tail op's)."""
        if r.op is not None:
            if op_name(r.op) == "vllm::moe_forward":
                return NoSite(r.op, f"this MoE has no shared expert ({r.op.name} is vllm::moe_forward)")
            return inside_moe_op(r, "the shared expert")
        topk = r.topk
        tk = topk if is_call(topk, OPS["router_topk"]) else None
        if tk is not None:
            logits = tk.args[0]
            w = next((u for u in tk.users if is_call(u, operator.getitem) and u.args[1] == 1), None)
        else:
            sel = selection(topk)
            if isinstance(sel, Fail):
                return sel
            logits, w = sel.logits, sel.weights
        src = strip(logits)
        if is_call(src, operator.getitem) and is_call(src.args[0], OPS["router_latent_sharded"]):
            x = strip(src.args[0].args[0], converts=True)
            gemms = set()
        else:
            if is_call(src, operator.getitem) and is_call(src.args[0], aten.split.Tensor, aten.split_with_sizes.default):
                src = strip(src.args[0].args[0])
            lin = match_linear(src)
            if isinstance(lin, Fail):
                return Fail(logits, f"cannot find the MoE input ({lin.reason})")
            x, gemms = lin.x, {src}
        tails = [u for u in (w.users if w is not None else ()) if is_call(u, OPS["moe_latent_tail"])]
        if tails:
            y = tails[0].args[0]
        else:
            f = finalize(w) if w is not None else Fail(topk, "the router's weights are not used")
            if isinstance(f, Fail):
                return f
            y = f[0]
        return self.match_shared(x, gemms, y, tk, role=True)

    def match_shared(self, x, skip, expert, topk=None, role=False):
        why = []  # why each candidate GEMM on x (or on a view of it) was not the shared expert
        base = strip(x, converts=True)   # an fp32 router reads x cast up; the shared expert reads x
        cands = users_through_views(x) + ([u for u in users_through_views(base) if u not in users_through_views(x)]
                                          if base is not x else [])
        for u in cands:
            if not is_call(u, aten.mm.default) or u in skip:
                continue
            up = match_linear(u)
            if isinstance(up, Fail) or not is_weight_like(up.w):
                why.append(f"{u.name}: {up.reason if isinstance(up, Fail) else 'its weight is computed'}")
                continue
            d = forward_gemm(u, limit=40)
            down = match_linear(d) if d is not None else Fail(u, "no down-projection after it")
            if isinstance(down, Fail) or down.residual is not None or not is_weight_like(down.w):
                why.append(f"{u.name}: no plain down-projection GEMM follows")
                continue
            act, up2 = self.situ_between([u], down.x), None
            if isinstance(act, Fail) and is_call(act.node, aten.mm.default):   # separate gate and up GEMMs?
                other = match_linear(act.node)
                if (not isinstance(other, Fail) and is_weight_like(other.w) and other.bias is None
                        and strip(other.x, converts=True) is strip(up.x, converts=True) and shape(other.out) == shape(u)):
                    act = self.situ_between([u, act.node], down.x)
                    if not isinstance(act, Fail):
                        gate_first, act = act[2], act[:2]
                        up, up2 = (up, other) if gate_first else (other, up)
            if isinstance(act, Fail):
                why.append(f"{u.name}: {act.reason}")
                continue
            if shape(d) is None or shape(d)[-1] != shape(x)[-1]:
                why.append(f"{u.name}: down-projection does not return to the hidden size")
                continue
            xs = strip(up.x)   # the shared GEMM's input, before any view of it made later in the graph
            found = dict(x=xs if shape(xs) == shape(up.x) else up.x, up=up, up2=up2, down=down, beta=act[0],
                         lbeta=act[1], expert=expert)
            if role:
                found["topk"] = topk   # the fused selection to pin the fork before, if fuse_router_topk ran
            return found
        return Fail(x, "no shared expert (x @ W_gu.T -> SiTU -> @ W_down.T back to hidden) on the MoE input"
                       + (f" ({'; '.join(why)})" if why else ""))

    def situ_between(self, starts, end):
        """(beta, linear_beta) if `end` is computed from `starts` by SiTU's elementwise ops only: one
        [gate | up] GEMM, or the gate and up GEMMs (then (beta, linear_beta, starts[0] is the gate))."""
        region, stack = set(), [end]
        while stack:
            n = stack.pop()
            if n in starts or n in region:
                continue
            if not is_call(n) or n.target not in _ELEMENTWISE:
                return Fail(n, f"shared expert activation contains {describe(n)}")
            region.add(n)
            stack.extend(a for a in n.args if hasattr(a, "op"))
            if len(region) > 40:
                return Fail(n, "shared expert activation is too large to be SiTU")
        gate = None
        if len(starts) == 2:   # the gate is the GEMM the sigmoid reads
            sig = [strip(n.args[0], views=True, converts=True) for n in region if is_call(n, aten.sigmoid.default)]
            if len(sig) != 1 or sig[0] not in starts:
                return Fail(end, "the shared expert's two GEMMs do not meet in SiTU (one sigmoid of the gate)")
            gate = sig[0]
        consts = {}
        for n in region:
            if is_call(n, aten.tanh.default):
                d = n.args[0]
                if is_call(d, aten.div.Tensor) and scalar(d.args[1]) is not None:
                    gi = strip(d.args[0], views=True, converts=True)
                    idx = ((0 if gi is gate else 1 if gi in starts else None) if gate is not None
                           else gi.args[1] if is_call(gi, operator.getitem)   # split(gu, n)[i] or gu[:, a:b]
                           else (0 if gi.args[2] in (0, None) else 1) if is_call(gi, aten.slice.Tensor) else None)
                    consts[idx] = scalar(d.args[1])
        if set(consts) != {0, 1}:
            return Fail(end, "shared expert activation is not SiTU (two tanh(x / c) on the gate and up halves)")
        return (consts[0], consts[1]) if gate is None else (consts[0], consts[1], gate is starts[0])

    def place_prefetch(self, graph, budget: int) -> int:
        nodes = list(graph.nodes)
        count = 0
        for i, n in enumerate(nodes):
            comm = None
            if is_call(n, *_FUSED_COMM) and _comm_arg(n, "group"):
                comm = n
            elif is_call(n, c10d.wait_tensor.default) and match_all_reduce(n):
                comm = n
            if comm is None:
                continue
            own = {strip(a, converts=True) for a in _flat(comm.args)}
            weights, total = [], 0
            for m in nodes[i + 1:]:
                if total >= budget or is_call(m, c10d.all_reduce.default, *_FUSED_COMM):
                    break
                if not is_call(m):
                    continue
                for a in _flat(m.args):
                    w = strip(a, converts=True)
                    v = val(w)
                    if (getattr(w, "op", None) == "placeholder" and isinstance(v, torch.Tensor) and v.dim() >= 2
                            and w not in own and w not in weights and isinstance(v.numel(), int)):
                        nbytes = v.numel() * v.element_size()
                        if total + nbytes > budget:
                            continue
                        weights.append(w)
                        total += nbytes
            if not weights:
                continue
            if comm.target in _FUSED_COMM:
                i = _arg_index(comm.target, "prefetch")
                comm.args = (*comm.args[:i], weights, *comm.args[i + 1:])
            else:
                ar = match_all_reduce(comm)
                comm.replace_all_uses_with(emit(graph, comm, OPS["all_reduce_prefetch"], (ar.inp, ar.group, weights)))
            count += 1
        return count


# the fused ops that communicate; each takes a `group` and a `prefetch` argument
_FUSED_COMM = (OPS["oproj_allreduce_residual"], OPS["residual_norm"], OPS["moe_latent_tail"])


def _arg_index(op, name: str) -> int:
    return next(i for i, a in enumerate(op._schema.arguments) if a.name == name)


def _comm_arg(n, name: str):
    """A fused communication op's argument by its schema name (positional in the passes' nodes)."""
    i = _arg_index(n.target, name)
    return n.args[i] if i < len(n.args) else n.kwargs.get(name)


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def _router_topk_of(expert):
    """The k3::router_topk node whose ids the routed-expert op reads (through converts), or None."""
    ids = strip(expert.args[1], converts=True) if len(expert.args) > 1 else None
    if is_call(ids, operator.getitem) and is_call(ids.args[0], OPS["router_topk"]):
        return ids.args[0]
    return None


def _order(graph):
    return {n: i for i, n in enumerate(graph.nodes)}
