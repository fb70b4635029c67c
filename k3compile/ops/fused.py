"""The `k3::` custom ops that the passes emit.

Each op has: a PyTorch reference (`reference.py`, any device), a fake implementation for
tracing, and a dispatch point (`k3compile.kernels.dispatch.pick`) where the GPU kernels plug in. The ops are functional (no input is mutated, no output aliases an input), so
Inductor treats them as ordinary extern kernels; the exceptions are `k3::kda_decode_gated`, `k3::kda_decode_fb`,
`k3::mla_decode_normed` and `k3::mla_decode_uv`, which take the place of the model's mutating
`k3model::kda_decode` / `k3model::mla_decode` inside their auto_functionalized nodes, and
`k3::kda_conv_decode_`, which fold_kda_conv puts in a new one on the conv-state input, and
`k3::kda_step_decode_`, which fold_kda_step puts in a new one on both states.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels import dispatch
from ..runtime import streams
from . import reference as ref


def _run(op: str, reference_fn, *args):
    dev = next((a.device.type for a in args if isinstance(a, Tensor)), "cpu")
    k = dispatch.pick(op, dev, *args)
    return (k.fn if k is not None else reference_fn)(*args)


# ----------------------------------------------------------------- 1. o-proj + all-reduce + residual (+ norm)
@torch.library.custom_op("k3::oproj_allreduce_residual", mutates_args=())
def oproj_allreduce_residual(x: Tensor, w: Tensor, residual: Tensor, blocks: list[Tensor],
                             w_norm: Optional[Tensor], w_qk: Optional[Tensor], g: Optional[Tensor],
                             eps: float, group: Optional[str], prefetch: list[Tensor], rounding: int = 0,
                             mix_rounding: int = 0, trigger: bool = False) -> tuple[Tensor, Tensor]:
    """(updated, normed): updated = residual + all_reduce(x @ w.T); normed = AttnRes post-norm of
    updated over `blocks` (plain RMSNorm(g) when there are none), or an empty tensor when g is None.
    `prefetch`: weights to pull into L2 while the all-reduce is in flight (GPU only).
    `rounding`: the post-norm's rounding order, `mix_rounding`: the mixer's (reference.NORM_* / MIX_*
    bits, as the model's graph rounds; 0: the reference model's).
    `trigger`: the next decode GEMM reads `normed` and is launched as this op's PDL secondary
    (`after_trigger`, set by the pass pair_pdl): at TP=1 the norm kernel lets it launch at its start
    (CUDA only; the reference ignores it)."""
    return _run("oproj_allreduce_residual",
                lambda *a: ref.oproj_allreduce_residual(*a[:9], *a[10:12]),
                x, w, residual, blocks, w_norm, w_qk, g, eps, group, prefetch, rounding, mix_rounding, trigger)


@oproj_allreduce_residual.register_fake
def _(x, w, residual, blocks, w_norm, w_qk, g, eps, group, prefetch, rounding=0, mix_rounding=0, trigger=False):
    return torch.empty_like(residual), (torch.empty_like(residual) if g is not None else residual.new_empty(0))


# ----------------------------------------------------------------- 1b. layer input: (all-reduce +) residual + norm
@torch.library.custom_op("k3::residual_norm", mutates_args=())
def residual_norm(delta: Tensor, residual: Tensor, blocks: list[Tensor], w_norm: Optional[Tensor],
                  w_qk: Optional[Tensor], g: Tensor, eps: float, group: Optional[str],
                  prefetch: list[Tensor], rounding: int = 0, mix_rounding: int = 0,
                  trigger: bool = False) -> tuple[Tensor, Tensor]:
    """(updated, normed): updated = residual + all_reduce(delta) (delta as it is when group is None);
    normed = the AttnRes mixer of updated over `blocks` (RMSNorm(g) when there are none).
    `prefetch`: weights to pull into L2 while the all-reduce is in flight (GPU only).
    `rounding` / `mix_rounding` / `trigger`: as k3::oproj_allreduce_residual's."""
    return _run("residual_norm", lambda *a: ref.residual_norm(*a[:8], *a[9:11]),
                delta, residual, blocks, w_norm, w_qk, g, eps, group, prefetch, rounding, mix_rounding, trigger)


@residual_norm.register_fake
def _(delta, residual, blocks, w_norm, w_qk, g, eps, group, prefetch, rounding=0, mix_rounding=0, trigger=False):
    return torch.empty_like(residual), torch.empty_like(residual)


# ----------------------------------------------------------------- 2. MoE finalize folded into the latent tail
@torch.library.custom_op("k3::moe_latent_tail", mutates_args=())
def moe_latent_tail(y: Tensor, topk_w: Tensor, shared_partial: Tensor, g_latent: Tensor, w_up: Tensor,
                    eps: float, rank: int, group: Optional[str], prefetch: list[Tensor],
                    rounding: int = 0) -> Tensor:
    """final_partial = shared_partial (+ at this rank's columns) up_proj(RMSNorm(all_reduce(sum_k w_k y_k))).
    shared_partial may come straight from k3::shared_expert_async: the current stream waits for the
    side stream that computes it before anything reads it. `rounding`: the latent norm's rounding
    order (reference.NORM_* bits)."""
    if shared_partial.is_cuda:
        streams.join(shared_partial)
    return _run("moe_latent_tail", lambda *a: ref.moe_latent_tail(*a[:8], *a[9:]),
                y, topk_w, shared_partial, g_latent, w_up, eps, rank, group, prefetch, rounding)


@moe_latent_tail.register_fake
def _(y, topk_w, shared_partial, g_latent, w_up, eps, rank, group, prefetch, rounding=0):
    return torch.empty_like(shared_partial)


@torch.library.custom_op("k3::mxfp4_experts", mutates_args=())
def mxfp4_experts(x: Tensor, topk_ids: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor,
                  w2_scale: Tensor, beta: float, linear_beta: float) -> Tensor:
    """`k3model::mxfp4_experts` lowered: the same contract (unweighted [N, k, L] outputs), with a
    dispatch point for the MXFP4 expert kernels; the reference is the model's own op."""
    return _run("mxfp4_experts", torch.ops.k3model.mxfp4_experts.default,
                x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta)


@mxfp4_experts.register_fake
def _(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta):
    return x.new_empty(topk_ids.shape[0], topk_ids.shape[1], x.shape[1])


def model_experts_on_kernels() -> None:
    """For baselines (bench): the model's own `k3model::mxfp4_experts` runs on CUDA through the MXFP4
    expert kernels that `k3::mxfp4_experts` dispatches to, instead of its capture-safe PyTorch path
    (every pair's expert dequantised to fp32: 9-10x slower and GiBs of temporaries at M >= 16), so an
    eager or Inductor step stands for a hand-written eager path and k3's lead is the passes'."""
    from ..model.moe_ops import mxfp4_experts_gathered

    def cuda_impl(*args):
        k = dispatch.pick("mxfp4_experts", "cuda", *args)
        return (k.fn if k is not None else mxfp4_experts_gathered)(*args)
    torch.library.register_kernel("k3model::mxfp4_experts", "cuda", cuda_impl)


# ----------------------------------------------------------------- 3. sharded router + latent projection
@torch.library.custom_op("k3::router_latent_sharded", mutates_args=())
def router_latent_sharded(x: Tensor, w_router: Tensor, w_down: Tensor, rank: int, tp: int,
                          group: Optional[str], router_fp32: bool = False,
                          after_trigger: bool = False) -> tuple[Tensor, Tensor]:
    """(x @ W_r.T, x @ W_down.T), each rank computing 1/tp of the rows of [W_r; W_down], all-gathered.
    router_fp32: the logits in fp32, as the model's x.float() @ W_r.float().T (gathered in fp32).
    after_trigger: x is the normed output of the norm op launched right before this one with `trigger`
    (pair_pdl): at TP=1 the GEMM is launched as its PDL secondary (CUDA only; the reference ignores it)."""
    return _run("router_latent_sharded", lambda *a: ref.router_latent_sharded(*a[:7]),
                x, w_router, w_down, rank, tp, group, router_fp32, after_trigger)


@router_latent_sharded.register_fake
def _(x, w_router, w_down, rank, tp, group, router_fp32=False, after_trigger=False):
    logits = x.new_empty(x.shape[0], w_router.shape[0], dtype=torch.float32 if router_fp32 else x.dtype)
    return logits, x.new_empty(x.shape[0], w_down.shape[0])


@torch.library.custom_op("k3::router_topk", mutates_args=())
def router_topk(logits: Tensor, bias: Tensor, k: int, scale: float,
                ids_int32: bool = False, after: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(ids [M, k], weights fp32 [M, k]): sigmoid router scores, top-k by score + bias, the
    selected scores renormalised to sum 1 times `scale` (one kernel on CUDA). ids are int64 (as
    torch.topk's), or int32 with ids_int32 (what the expert kernels read: no conversion kernel).
    `after` is not read: an ordering dependency (overlap_shared_expert passes the side-stream fork's
    output, so no scheduler launches the top-k before the fork)."""
    return _run("router_topk", lambda lg, b, kk, sc, i32, _a: ref.router_topk(lg, b, kk, sc, i32),
                logits, bias, k, scale, ids_int32, after)


@router_topk.register_fake
def _(logits, bias, k, scale, ids_int32=False, after=None):
    M = logits.shape[0]
    return (logits.new_empty(M, k, dtype=torch.int32 if ids_int32 else torch.int64),
            logits.new_empty(M, k, dtype=torch.float32))


# ----------------------------------------------------------------- 4. side stream + prefetch
@torch.library.custom_op("k3::shared_expert_async", mutates_args=())
def shared_expert_async(x: Tensor, w_gate_up: Tensor, w_down: Tensor, beta: float, linear_beta: float,
                        after: Optional[Tensor] = None, w_up: Optional[Tensor] = None) -> Tensor:
    """The SiTU shared expert's TP-partial output, launched on the side stream (GPU); the result
    may only be read after `k3::stream_join`. `after` is not read: an ordering dependency (the
    router logits, so no scheduler forks before the router GEMM). With `w_up`, `w_gate_up` is the
    gate projection alone and `w_up` the up projection (a model with two weights)."""
    return _run("shared_expert_async", lambda a, gu, dn, b, lb, _a, wu: ref.shared_expert_split(a, gu, dn, b, lb, wu),
                x, w_gate_up, w_down, beta, linear_beta, after, w_up)


@shared_expert_async.register_fake
def _(x, w_gate_up, w_down, beta, linear_beta, after=None, w_up=None):
    return x.new_empty(x.shape[0], w_down.shape[0])


@torch.library.custom_op("k3::stream_join", mutates_args=())
def stream_join(x: Tensor, after: Tensor) -> Tensor:
    """Makes the current stream wait for the side stream that produced `x`; returns x's value.
    `after` is not read: it is the routed work the side stream overlaps with, a data dependency
    that keeps any scheduler from hoisting the join above that work."""
    return _run("stream_join", lambda t, _a: t.clone(), x, after)


@stream_join.register_fake
def _(x, after):
    return torch.empty_like(x)


@torch.library.custom_op("k3::all_reduce_prefetch", mutates_args=())
def all_reduce_prefetch(x: Tensor, group: str, prefetch: list[Tensor]) -> Tensor:
    """all_reduce(x) (sum over `group`), pulling `prefetch` weights into L2 while it is in flight (GPU)."""
    return _run("all_reduce_prefetch", lambda t, grp, _p: ref.all_reduce(t, grp).clone(), x, group, prefetch)


@all_reduce_prefetch.register_fake
def _(x, group, prefetch):
    return torch.empty_like(x)


# ----------------------------------------------------------------- KDA decode with its prologue (fold_kda_gate)
@torch.library.custom_op("k3::kda_decode_gated", mutates_args=("state",))
def kda_decode_gated(q: Tensor, k: Tensor, v: Tensor, f: Tensor, beta: Tensor, a_log: Tensor, dt_bias: Tensor,
                     state: Tensor, lower: float, scale: float, eps: float, qk_dtype: torch.dtype) -> Tensor:
    """`k3model::kda_decode` with the prologue folded in: q, k raw ([M, H, K], L2-normalised here, q
    scaled), f the raw gate input (decay = lower * sigmoid(exp(A_log) * (f + dt_bias))), beta the raw
    logits. Mutates `state` like kda_decode (the one k3 op that mutates an input: it replaces a
    mutating op in place). On CUDA with fla-core: one fused_recurrent_kda kernel with in-kernel
    norms, gate and beta sigmoid."""
    return _run("kda_decode_gated", ref.kda_decode_gated, q, k, v, f, beta, a_log, dt_bias, state, lower, scale,
                eps, qk_dtype)


@kda_decode_gated.register_fake
def _(q, k, v, f, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype):
    return v.new_empty(v.shape)


@torch.library.custom_op("k3::kda_decode_fb", mutates_args=("state",))
def kda_decode_fb(q: Tensor, k: Tensor, v: Tensor, fa: Tensor, f_b: Tensor, beta: Tensor, a_log: Tensor,
                  dt_bias: Tensor, state: Tensor, lower: float, scale: float, eps: float,
                  qk_dtype: torch.dtype) -> Tensor:
    """`k3::kda_decode_gated` with the gate's up-projection folded in: f = (fa @ f_b.T) as [M, H, K],
    fa [M, R] the low-rank gate input, f_b [H * K, R] its weight (fold_kda_fb). Mutates `state`. On
    CUDA: one Triton kernel (kernels/triton_kda.py) doing the f_b GEMV, the norms, the gate and the
    recurrence, where cuBLAS's GEMV and fla's kernel ran one after the other."""
    return _run("kda_decode_fb", ref.kda_decode_fb, q, k, v, fa, f_b, beta, a_log, dt_bias, state, lower, scale,
                eps, qk_dtype)


@kda_decode_fb.register_fake
def _(q, k, v, fa, f_b, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype):
    return v.new_empty(v.shape)


@torch.library.custom_op("k3::kda_step_decode_", mutates_args=("conv_state", "state"))
def kda_step_decode_(xq: Tensor, xk: Tensor, xv: Tensor, w: Tensor, fa: Tensor, f_b: Tensor, beta: Tensor,
                     a_log: Tensor, dt_bias: Tensor, conv_state: Tensor, state: Tensor, lower: float, scale: float,
                     eps: float, qk_dtype: torch.dtype, o_norm: Optional[Tensor] = None, gate: Optional[Tensor] = None,
                     o_eps: float = 0.0) -> Tensor:
    """The whole KDA decode step from the input projection's slices: `k3::kda_conv_decode_` (conv_state
    shifted in place) and `k3::kda_decode_fb` (state updated in place) in one (fold_kda_step); o [M, H, V].
    With o_norm (fold_kda_onorm): the output norm too, rms_norm(o, o_norm, o_eps) * sigmoid(gate) with
    gate [M, H * V] (unit stride along it). On CUDA: one Triton kernel (kernels/triton_kda.py)."""
    return _run("kda_step_decode_", ref.kda_step_decode_, xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state,
                state, lower, scale, eps, qk_dtype, o_norm, gate, o_eps)


@kda_step_decode_.register_fake
def _(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state, state, lower, scale, eps, qk_dtype, o_norm=None,
      gate=None, o_eps=0.0):
    M, H = xq.shape[0], a_log.shape[0]
    return xv.new_empty(M, H, xv.shape[1] // H)


# ----------------------------------------------------------------- MLA decode with its prologue (fold_mla_prologue)
@torch.library.custom_op("k3::mla_decode_normed", mutates_args=("kv_cache",))
def mla_decode_normed(q_lat: Tensor, q_rope: Tensor, kv_a: Tensor, kv_norm_w: Tensor, eps: float, kv_cache: Tensor,
                      seq_lens: Tensor, scale: float, rounding: int = 0) -> Tensor:
    """`k3model::mla_decode` with the kv_a RMSNorm folded in: kv_a [M, L + R] is the raw latent + rope
    key of the new token (its first L columns RMS-normalised by kv_norm_w here, in the rounding order
    `rounding` (k3compile/rounding.py), the rest taken as they are); q_rope may be a strided view (unit stride along R). Mutates `kv_cache` like
    mla_decode (it replaces that mutating op in place). On CUDA: the Triton MLA decode with the norm
    in its split kernel."""
    return _run("mla_decode_normed", ref.mla_decode_normed, q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens,
                scale, rounding)


@mla_decode_normed.register_fake
def _(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale, rounding=0):
    return q_lat.new_empty(q_lat.shape)


@torch.library.custom_op("k3::mla_decode_uv", mutates_args=("kv_cache",))
def mla_decode_uv(q_lat: Tensor, q_rope: Tensor, kv_a: Tensor, kv_norm_w: Tensor, eps: float, kv_cache: Tensor,
                  seq_lens: Tensor, scale: float, w_uv: Tensor, w_nk: bool, gate: Optional[Tensor] = None,
                  rounding: int = 0) -> Tensor:
    """k3::mla_decode_normed followed by k3::decode_bmm(o.permute(1, 0, 2), w_uv, w_nk, gate) (the MLA
    value up-projection with its sigmoid output gate): [H, M, V], stored token-major like decode_bmm's
    result. Mutates `kv_cache`. On CUDA: the Triton split kernel, then one kernel that combines the
    splits and multiplies by W_uv (no o_lat in memory, one launch fewer)."""
    return _run("mla_decode_uv", ref.mla_decode_uv, q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale,
                w_uv, w_nk, gate, rounding)


@mla_decode_uv.register_fake
def _(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale, w_uv, w_nk, gate=None, rounding=0):
    M, H = q_lat.shape[0], q_lat.shape[1]
    return q_lat.new_empty(M, H, w_uv.shape[1] if w_nk else w_uv.shape[2]).permute(1, 0, 2)


# ----------------------------------------------------------------- KDA short conv at decode (fold_kda_conv)
@torch.library.custom_op("k3::kda_conv_decode", mutates_args=())
def kda_conv_decode(xq: Tensor, xk: Tensor, xv: Tensor, state: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, k, v, new_state): the KDA depthwise causal conv + SiLU for one new token over channels
    [xq | xk | xv] ([M, C/3] each) with the last KW - 1 inputs in `state` [M, C, KW - 1] and weights
    w [C, KW]; q, k, v contiguous [M, C/3]; new_state [M, C, KW - 1] (written back into the state by
    the graph's own copy). One Triton kernel on CUDA."""
    return _run("kda_conv_decode", ref.kda_conv_decode, xq, xk, xv, state, w)


@kda_conv_decode.register_fake
def _(xq, xk, xv, state, w):
    M, cq = xq.shape
    return (xq.new_empty(M, cq), xq.new_empty(M, cq), xq.new_empty(M, cq), state.new_empty(state.shape))


@torch.library.custom_op("k3::kda_conv_decode_", mutates_args=("state",))
def kda_conv_decode_(xq: Tensor, xk: Tensor, xv: Tensor, state: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """kda_conv_decode with the new state written into `state` in place; (q, k, v). fold_kda_conv
    emits it inside an auto_functionalized node on the graph's conv-state input, which Inductor
    turns back into the in-place call: no copy of the new state into the cache after it."""
    k = dispatch.pick("kda_conv_decode_", state.device.type, xq, xk, xv, state, w)
    return (k.fn if k is not None else ref.kda_conv_decode_)(xq, xk, xv, state, w)


@kda_conv_decode_.register_fake
def _(xq, xk, xv, state, w):
    M, cq = xq.shape
    return (xq.new_empty(M, cq), xq.new_empty(M, cq), xq.new_empty(M, cq))


# ----------------------------------------------------------------- decode GEMMs (lower_decode_gemm)
@torch.library.custom_op("k3::decode_gemm", mutates_args=())
def decode_gemm(x: Tensor, w: Tensor, after_trigger: bool = False) -> Tensor:
    """x @ w.T for a weight w [N, K] (F.linear without bias); on CUDA the tensor-core split-K
    decode GEMM where the tuned table has this weight shape and M (kernels/tuning.GEMV_TABLE),
    else cuBLAS. after_trigger: x is the normed output of the norm op launched right before this one
    with `trigger` (pair_pdl): a CUDA-core GEMV is then launched as its PDL secondary (CUDA only; the
    reference ignores it)."""
    return _run("decode_gemm", lambda a, b, _t: torch.mm(a, b.t()), x, w, after_trigger)


@decode_gemm.register_fake
def _(x, w, after_trigger=False):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("k3::decode_bmm", mutates_args=())
def decode_bmm(x: Tensor, w: Tensor, w_nk: bool, gate: Optional[Tensor] = None) -> Tensor:
    """torch.bmm(x, w) for a per-head weight w [H, K, N] (w_nk: w stored [H, N, K], the product with its
    transpose), x [H, M, K] of few tokens; with gate [M, H, N], times sigmoid(gate) transposed to
    [H, M, N]. The [H, M, N] result is stored token-major (a permuted view of a contiguous [M, H, N]).
    On CUDA one Triton kernel (kernels/gemm.head_bmm) instead of cuBLAS's batched GEMM (and the gate's kernel)."""
    return _run("decode_bmm", ref.decode_bmm, x, w, w_nk, gate)


@decode_bmm.register_fake
def _(x, w, w_nk, gate=None):
    return x.new_empty(x.shape[1], x.shape[0], w.shape[1] if w_nk else w.shape[2]).permute(1, 0, 2)


OPS = {
    "oproj_allreduce_residual": torch.ops.k3.oproj_allreduce_residual.default,
    "residual_norm": torch.ops.k3.residual_norm.default,
    "moe_latent_tail": torch.ops.k3.moe_latent_tail.default,
    "mxfp4_experts": torch.ops.k3.mxfp4_experts.default,
    "router_latent_sharded": torch.ops.k3.router_latent_sharded.default,
    "router_topk": torch.ops.k3.router_topk.default,
    "shared_expert_async": torch.ops.k3.shared_expert_async.default,
    "stream_join": torch.ops.k3.stream_join.default,
    "all_reduce_prefetch": torch.ops.k3.all_reduce_prefetch.default,
    "kda_decode_gated": torch.ops.k3.kda_decode_gated.default,
    "kda_decode_fb": torch.ops.k3.kda_decode_fb.default,
    "kda_step_decode_": torch.ops.k3.kda_step_decode_.default,
    "kda_conv_decode": torch.ops.k3.kda_conv_decode.default,
    "kda_conv_decode_": torch.ops.k3.kda_conv_decode_.default,
    "mla_decode_normed": torch.ops.k3.mla_decode_normed.default,
    "mla_decode_uv": torch.ops.k3.mla_decode_uv.default,
    "decode_gemm": torch.ops.k3.decode_gemm.default,
    "decode_bmm": torch.ops.k3.decode_bmm.default,
}
