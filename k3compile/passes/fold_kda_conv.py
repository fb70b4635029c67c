"""fold_kda_conv: the KDA short convolution of one decode token -> one k3::kda_conv_decode.

Matches, once per KDA layer at decode (anchored on each auto-functionalized KDA decode core,
k3model::kda_decode or fold_kda_gate's k3::kda_decode_gated, walking back from its v):
    window    = cat([conv_state, cat([Xq, Xk, Xv], -1) as [M, C, 1]], -1)      # [M, C, KW]
    new_state = window[..., -(KW - 1):]                  (the graph writes it back into conv_state)
    y         = silu(sum(unfold(window, -1, KW, 1) * w[:, None, :], -1)) as [M, C]
    q, k, v   = split(y, C / 3, -1)
(`patterns.kda.match_kda_conv` has the ATen forms: SiLU decomposed or not, permutes and views
looked through.)
Emits:
    q, k, v, new_state = auto_functionalized_v2(k3::kda_conv_decode_, xq=Xq, xk=Xk, xv=Xv, w=w,
                                                _all_bases=[conv_state])
    (auto_functionalized(..., state=conv_state) where the graph's KDA cores have that first form)
the in-place op (the new state written into conv_state) in the functional form AOT gives a
mutating op, which Inductor turns back into the in-place call: the graph's write-back of the new
state into the cache (a copy kernel, 1 us at decode on an H200) goes away. Its CUDA path is one
Triton kernel (kernels/triton_conv.py) instead of Inductor's window concatenation, the state
slice, the conv + SiLU, the contiguous copies of q, k, v the recurrence op takes and the
write-back; its reference is the model's math (ops/reference.kda_conv_decode_), bit-identical
on CPU. (K3_KNOBS=conv_inplace=0 emits the functional k3::kda_conv_decode instead, whose new state the
graph writes back.)
Skipped: model dtype / TP size not supported, static M outside the pass's batch range; on CUDA with
Inductor, M outside its pipeline row's CUDA range (passes/pipeline.py) (M = 1..16: at M=1 with the other passes 3.4 us faster per
KDA layer step on an H200, 4 kernels fewer; slower alone; at M = 4, 16 faster with fold_kda_gate and
fold_kda_fb; without fb: +1.2 / +0.2 us). Near-miss: a core whose v is not a slice of such a
conv (the step where the chain differs: not SiLU, not a sum over the window, more than one new
token, a window used elsewhere). Prefill (kda_prefill, T > 1 tokens) is left as it is.
"""
from __future__ import annotations


import torch

from ..ops import OPS
from ..patterns.kda import match_kda_conv
from ..patterns.structure import op_name
from ..config import knob_flag
from .base import K3Pass
from .pipeline import register
from .common import emit, emit_functionalized, getitem, last_of, replace

_CORES = ("k3model::kda_decode", "k3::kda_decode_gated", "k3::kda_decode_fb")
# the in-place op by default (K3_KNOBS=conv_inplace=0 / 1 overrides: the A/B rows of bench/layer_bench.py)
INPLACE = True


@register
class FoldKdaConv(K3Pass):
    name = "fold_kda_conv"
    core = "KDA"   # rewrites the reference model's KDA attention-core op: skipped (with a reason) without it
    description = "KDA short conv + SiLU of one decode token (window, state slice, conv, q/k/v copies) -> k3::kda_conv_decode"
    pattern = "split(silu(sum(unfold(cat([state, cat(Xq, Xk, Xv)])) * w)), C/3) -> the KDA decode core (per KDA decode layer)"
    emits = "k3::kda_conv_decode_, in place on the conv-state input (auto-functionalized)"

    def expected(self, info):
        return sum(op_name(n) in _CORES for n in info.attention)

    def run(self, graph, info, opts, report):
        cores = [n for n in info.attention if op_name(n) in _CORES]
        # the functionalized form the graph's own mutating ops have (v1 where Inductor's
        # enable_auto_functionalized_v2 is off, as vLLM sets it)
        v2 = not any(n.target is torch.ops.higher_order.auto_functionalized for n in cores)
        for s in self.collect(cores, match_kda_conv, report):
            after = last_of(graph, [s.xq, s.xk, s.xv, s.state, s.w])
            if not knob_flag("conv_inplace", INPLACE):   # the functional op
                op = emit(graph, after, OPS["kda_conv_decode"], (s.xq, s.xk, s.xv, s.state, s.w))
            else:
                op = emit_functionalized(graph, after, OPS["kda_conv_decode_"], dict(xq=s.xq, xk=s.xk, xv=s.xv, w=s.w),
                                         dict(state=s.state), v2=v2)
            outs = [getitem(graph, op, i) for i in range(4)]
            for part, new in zip(s.parts, outs[:3]):
                replace(graph, part, new)
            replace(graph, s.new_state, outs[3])
            report.matched += 1
