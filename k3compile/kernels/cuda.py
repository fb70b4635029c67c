"""CUDA implementations of the `k3::` ops (imported lazily by `registry` on first CUDA use).

- oproj_allreduce_residual: cuBLAS GEMM, then one Triton kernel: copy of the partial into this
  rank's symmetric buffer, barrier, peer loads over NVLink (one-shot all-reduce), residual add,
  AttnRes / RMSNorm post-norm. At TP=1 the same kernel without peers. Where `choose.push_gemm`
  picks it, the CuTe push GEMM instead stores the partial into every rank's buffer with per-tile
  flags, and the Triton kernel waits on the flags and reads only its own buffer. At one row and
  TP >= 2 (launch.cols_plan) the kernel's column-split form (kernels/triton_cols.py) instead.
- residual_norm: the o-proj op's all-reduce + residual + norm kernel on a given delta (no GEMM);
  at TP=1, or for a delta that is no all-reduce's, the same kernel without peers.
- moe_latent_tail: one Triton kernel (weighted top-k finalize into the symmetric buffer,
  one-shot all-reduce, RMSNorm, copy of the shared partial), then a cuBLAS addmm adding the
  up-projection shard into this rank's columns (the column-split kernel where launch.cols_plan says).
- router_latent_sharded: one GEMM on this rank's rows of [W_r; W_down] (a view of one weight, or
  for the one rank whose rows straddle both one launch over both (`launch.mma_gemm2`) where the
  tuned config's tile divides its router rows, else a copy made once, `launch.rank_rows`), then
  one Triton kernel: copy into the symmetric buffer, all-gather, write router logits and latent.
  Above its one-shot range it runs the replicated GEMMs (what the unrewritten graph did). At TP=1:
  both GEMMs in one launch of the decode GEMM over the stacked weights (`launch.router_latent_one`).
- router_topk: one Triton kernel per call (sigmoid, biased top-k, renormalised weights).
- all_reduce_prefetch: one Triton kernel (copy in, one-shot all-reduce).
- L2 prefetch: on the side stream, started before the communication kernel, joined after it.
- mxfp4_experts: two Triton kernels (gate-up + SiTU, down), dequantising MXFP4 in registers.
- shared_expert_async / stream_join: the side-stream shared expert (GEMM, one SiTU kernel, GEMM).
- decode_gemm: the Triton tensor-core split-K GEMM (or the CUDA-core GEMV) with the config of the
  tuned table (choose.GEMV_TABLE) where it has this weight shape and M, else torch.mm (cuBLAS). The
  GEMMs inside the ops above go through the same table (choose.gemm).
- decode_bmm: one Triton kernel (launch.head_bmm: heads x N blocks, tl.dot per K step), M <= 16.
- kda_conv_decode (and kda_conv_decode_, in place): one Triton kernel (kernels/triton_conv.py): the KDA
  short conv + SiLU of one token.
- mla_decode_normed: the Triton MLA decode (kernels/triton_mla.py) with the kv_a RMSNorm in its
  split kernel, where launch.mla_decode_fits takes the shapes (and K3_KNOBS mla_triton is not 0).
- mla_decode_uv: the same split kernel, then one kernel combining the splits and applying the
  value up-projection (and the sigmoid output gate) per (token, head, value block).
- kda_decode_gated: one fla-core fused_recurrent_kda kernel with the q/k L2 norms, the gate and
  beta's sigmoid in the kernel and the state updated in place (where fla-core imports).
- kda_decode_fb: one Triton kernel (kernels/triton_kda.py): the gate's f_b GEMV, the norms, the gate
  and the recurrence, per (token, head, block of value columns); the state updated in place.
- kda_step_decode_: one Triton kernel (kernels/triton_kda.py): kda_decode_fb's with the short conv of
  the head's q, k, v channels in front, both states updated in place.

Each kernel accepts a call only where it is correct: bf16/fp16/fp32 2-D contiguous inputs. The norm
kernels take the model's rounding order (the ops' rounding / mix_rounding arguments, launch.rnd_bits):
where a norm is written in the 16-bit input dtype, or the AttnRes keys are normed with their own
weight, the registration declines and the op's reference runs. The
one-shot path needs a TP group with a symmetric-memory workspace large enough for the call and
M within `ONESHOT_M` (measured); otherwise the op takes its NCCL path (GEMM, NCCL
collective, our norm kernel), and `runtime.symm.status()` says why symmetric memory is absent.
K3_KERNELS=0 turns every kernel off.
"""
from __future__ import annotations

from ..config import knob

import torch

from ..model.functional import situ_mlp
from ..ops import reference as ref
from ..runtime import streams, symm
from . import choose, launch
from .registry import register


# M range [lo, hi] where the one-shot symmetric-memory path is used; outside it the op runs its
# "NCCL path" (GEMM + in-place NCCL + our norm kernel; the router: the replicated GEMMs). From
# bench/ops_bench.py (2 x H200; bench/results/ops_bench_h200x2.json, BENCHMARKS.md): one-shot won
# at every measured M (1..256) for the o-proj and the latent tail, at M <= 16 for the router, and
# at M >= 4 for the plain all-reduce (at M=1 NCCL was 3-7% faster).
# residual_norm runs the o-proj op's kernel without its GEMM: its range is the o-proj op's.
ONESHOT_M = {"oproj_allreduce_residual": (1, 1 << 30), "moe_latent_tail": (1, 1 << 30),
             "residual_norm": (1, 1 << 30), "router_latent_sharded": (1, 16), "all_reduce_prefetch": (2, 1 << 30)}


def _nccl_all_reduce_(t: torch.Tensor, group: str) -> torch.Tensor:
    """In-place NCCL all-reduce through c10d (capturable; no functional-collective copy)."""
    import torch.distributed as dist
    dist.all_reduce(t, group=dist.distributed_c10d._resolve_process_group(group))
    return t


def _peers(group: str | None, device, nbytes: int, op: str | None = None, m: int = 0):
    """(ok, peers): peers is None at TP=1; ok is False when the group cannot use symmetric memory
    (or M is above the op's one-shot range)."""
    if not group:
        return True, None
    if op is not None and not ONESHOT_M[op][0] <= m <= ONESHOT_M[op][1]:
        return False, None
    ws = symm.workspace(group, device)
    if ws is None or not ws.fits(nbytes):
        if ws is not None:
            symm.note_unavailable(f"{group}/size", f"a call needs {nbytes} bytes > workspace {ws.buf.numel()}")
        return False, None
    return True, launch.Peers(ws.ptrs, ws.pads, ws.epoch, ws.rank, ws.world, ws.data_bytes, ws.programs, ws.flag_off)


def _prefetcher(weights: list[torch.Tensor]):
    """start() -> join(): L2 prefetch of `weights` on the side stream while the caller communicates."""
    def start():
        if not weights:
            return lambda: None
        side = streams.side_stream(weights[0].device)
        cur = torch.cuda.current_stream(weights[0].device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for w in weights:
                if w.is_contiguous():
                    launch.l2_prefetch(w)
            ev = torch.cuda.Event()
            ev.record(side)
        return lambda: cur.wait_event(ev)
    return start


_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


def _rounds_as_kernels(rounding: int, mix_rounding: int = 0) -> bool:
    """Whether the norm kernels follow these rounding orders (ops/reference.py's bits; launch.rnd_bits):
    not a norm computed in the 16-bit input dtype, nor AttnRes keys normed with their own weight
    (the kernels dot the normed row with w_norm * w_qk): those run the op's reference."""
    return not (rounding & ref.NORM_IN_DTYPE or mix_rounding & (ref.NORM_IN_DTYPE | ref.MIX_KEY_WEIGHTED))


def _ok_oproj(x, w, residual, blocks, w_norm, w_qk, g, eps, group, prefetch, rounding=0, mix_rounding=0):
    return (x.dim() == 2 and residual.dim() == 2 and x.dtype in _FLOAT and w.dtype == x.dtype
            and residual.dtype == x.dtype and len(blocks) <= 8 and residual.is_contiguous()
            and all(b.is_contiguous() and b.shape == residual.shape for b in blocks)
            and _rounds_as_kernels(rounding, mix_rounding))


@register("oproj_allreduce_residual", "cuda", "symm_oneshot_triton", _ok_oproj)
def _oproj(x, w, residual, blocks, w_norm, w_qk, g, eps, group, prefetch, rounding=0, mix_rounding=0):
    M, N = residual.shape
    rnd = launch.rnd_bits(rounding, mix_rounding)
    ok, peers = _peers(group, x.device, M * N * x.element_size(), "oproj_allreduce_residual", M)
    if not ok:  # NCCL path: GEMM, NCCL all-reduce, our residual + norm kernel
        y = _nccl_all_reduce_(torch.mm(x, w.t()), group)
        return launch.ar_residual_norm(y, None, residual, g, w_norm, w_qk, list(blocks), eps, None, rnd)
    return launch.oproj(x, w, peers, residual, blocks, w_norm, w_qk, g, eps, _prefetcher(prefetch),
                        choose.push_gemm(x, w, peers, group), rnd)


def _ok_resnorm(delta, residual, blocks, w_norm, w_qk, g, eps, group, prefetch, rounding=0, mix_rounding=0):
    return (delta.dim() == 2 and delta.dtype in _FLOAT and delta.is_contiguous() and residual.dtype == delta.dtype
            and residual.shape == delta.shape and residual.is_contiguous() and len(blocks) <= 8
            and all(b.is_contiguous() and b.shape == residual.shape for b in blocks)
            and _rounds_as_kernels(rounding, mix_rounding))


@register("residual_norm", "cuda", "symm_oneshot_triton", _ok_resnorm)
def _resnorm(delta, residual, blocks, w_norm, w_qk, g, eps, group, prefetch, rounding=0, mix_rounding=0):
    M, N = residual.shape
    ok, peers = _peers(group, delta.device, M * N * delta.element_size(), "residual_norm", M)
    if not ok:  # NCCL path: NCCL all-reduce, then our residual + norm kernel
        delta, peers = _nccl_all_reduce_(delta.clone(), group), None
    return launch.residual_norm(delta, peers, residual, blocks, w_norm, w_qk, g, eps, _prefetcher(prefetch),
                                launch.rnd_bits(rounding, mix_rounding))


def _ok_tail(y, topk_w, shared_partial, g_latent, w_up, eps, rank, group, prefetch, rounding=0):
    return (y.dim() == 3 and y.dtype in _FLOAT and y.is_contiguous() and shared_partial.dtype == y.dtype
            and shared_partial.is_contiguous() and w_up.dtype == y.dtype and topk_w.shape == y.shape[:2]
            and _rounds_as_kernels(rounding))


@register("moe_latent_tail", "cuda", "symm_oneshot_triton", _ok_tail)
def _tail(y, topk_w, shared_partial, g_latent, w_up, eps, rank, group, prefetch, rounding=0):
    M, topk, L = y.shape
    rnd = launch.rnd_bits(rounding)
    ok, peers = _peers(group, y.device, M * L * y.element_size(), "moe_latent_tail", M)
    if not ok:  # NCCL path: finalize, NCCL all-reduce, our norm kernel, addmm into a copy
        routed = _nccl_all_reduce_((y.float() * topk_w.unsqueeze(-1)).sum(1).to(y.dtype), group)
        _, ln = launch.ar_residual_norm(routed, None, None, g_latent, None, None, [], eps, None, rnd)
        return launch.add_up_shard(shared_partial.clone(), ln, w_up, rank)
    return launch.moe_tail(y, topk_w, peers, shared_partial, g_latent, w_up, eps, rank, _prefetcher(prefetch),
                           rnd)


def _ok_router(x, w_router, w_down, rank, tp, group, router_fp32=False):
    return (not router_fp32 and x.dim() == 2 and x.dtype in _FLOAT and w_router.dtype == x.dtype and w_down.dtype == x.dtype
            and bool(group) and (w_router.shape[0] + w_down.shape[0]) % tp == 0)


def _ok_router1(x, w_router, w_down, rank, tp, group, router_fp32=False):
    return (not router_fp32 and tp == 1 and not group and x.dim() == 2 and x.dtype in _FLOAT and w_router.dtype == x.dtype
            and w_down.dtype == x.dtype and w_router.shape[1] == w_down.shape[1] == x.shape[1])


@register("router_latent_sharded", "cuda", "one_gemm_triton", _ok_router1)
def _router1(x, w_router, w_down, rank, tp, group, router_fp32=False):
    return launch.router_latent_one(x, w_router, w_down)


@register("router_latent_sharded", "cuda", "symm_allgather_triton", _ok_router)
def _router(x, w_router, w_down, rank, tp, group, router_fp32=False):
    S = (w_router.shape[0] + w_down.shape[0]) // tp
    ok, peers = _peers(group, x.device, x.shape[0] * S * x.element_size(), "router_latent_sharded", x.shape[0])
    if not ok or peers.world != tp or peers.rank != rank:
        # above the one-shot range the replicated GEMMs are faster than any gather
        return torch.mm(x, w_router.t()), torch.mm(x, w_down.t())
    return launch.router_latent(x, w_router, w_down, peers)


def _topk_ok(E, bias, k):
    """The router top-k kernel's selection over E experts: the bias, k and E it takes."""
    return (bias.dim() == 1 and bias.is_contiguous() and bias.dtype in _FLOAT and bias.shape[0] == E
            and 0 < k <= min(64, E) and E <= launch.ROUTER_TOPK_MAX_E)


def _ok_topk(logits, bias, k, scale, ids_int32=False, after=None):
    return (logits.dim() == 2 and logits.is_contiguous() and logits.dtype in _FLOAT
            and _topk_ok(logits.shape[1], bias, k))


@register("router_topk", "cuda", "triton_router_topk", _ok_topk)
def _router_topk(logits, bias, k, scale, ids_int32=False, after=None):
    return launch.router_topk(logits, bias, k, scale, torch.int32 if ids_int32 else torch.int64)


def _ok_ar(x, group, prefetch):
    return x.dim() == 2 and x.dtype in _FLOAT and x.is_contiguous() and bool(group)


@register("all_reduce_prefetch", "cuda", "symm_oneshot_triton", _ok_ar)
def _all_reduce(x, group, prefetch):
    ok, peers = _peers(group, x.device, x.numel() * x.element_size(), "all_reduce_prefetch", x.shape[0])
    if not ok:
        return _nccl_all_reduce_(x.clone(), group)
    return launch.all_reduce(x, peers, _prefetcher(prefetch))


def _ok_experts(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta):
    return x.dtype in _FLOAT and launch.mxfp4_experts_ok(x, topk_ids, w13)


@register("mxfp4_experts", "cuda", "triton_mxfp4", _ok_experts)
def _experts(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta):
    return launch.mxfp4_experts(x, topk_ids, w13, w13_scale, w2, w2_scale, beta, linear_beta)


def _ok_kda_gated(q, k, v, f, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype):
    from ..model import attention_ops as A
    # fla's in-kernel L2 norm adds 1e-6 under the square root: the same as clamping at eps <= 1e-6
    # for any vector whose norm is not tiny
    return (A.fla_fused_recurrent_kda() is not None and A.fla_fused_recurrent_kda_fwd() is not None
            and q.dim() == 3 and q.shape[0] > 0 and q.shape[-1] <= 256 and state.dtype == torch.float32
            and state.is_contiguous() and eps <= 1e-6)


@register("kda_decode_gated", "cuda", "fla_fused_recurrent_kda", _ok_kda_gated)
def _kda_gated(q, k, v, f, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype):
    return launch.kda_decode_gated_fla(q, k, v, f, beta, a_log, dt_bias, state, lower, scale)


def _ok_kda_fb(q, k, v, fa, f_b, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype):
    return qk_dtype in launch._TL and launch.kda_decode_fb_fits(q, k, v, fa, f_b, beta, a_log, dt_bias, state)


@register("kda_decode_fb", "cuda", "triton_kda_fb", _ok_kda_fb)
def _kda_fb(q, k, v, fa, f_b, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype):
    return launch.kda_decode_fb(q, k, v, fa, f_b, beta, a_log, dt_bias, state, lower, scale, eps, qk_dtype)


def _ok_kda_step(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state, state, lower, scale, eps, qk_dtype,
                 o_norm=None, gate=None, o_eps=0.0):
    return (qk_dtype in launch._TL and launch.kda_step_decode_fits(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias,
                                                                   conv_state, state)
            and (o_norm is None or launch.kda_onorm_fits(xq, xv, a_log, o_norm, gate)))


@register("kda_step_decode_", "cuda", "triton_kda_step", _ok_kda_step)
def _kda_step(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state, state, lower, scale, eps, qk_dtype,
              o_norm=None, gate=None, o_eps=0.0):
    return launch.kda_step_decode(xq, xk, xv, w, fa, f_b, beta, a_log, dt_bias, conv_state, state, lower, scale, eps,
                                  qk_dtype, o_norm, gate, o_eps)


def _ok_mla_normed(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale):
    from . import model_ops
    L = q_lat.shape[-1] if q_lat.dim() == 3 else -1
    return (model_ops.MLA_TRITON and launch.mla_decode_fits(q_lat, q_rope, kv_a, kv_cache)
            and kv_norm_w.shape == (L,) and kv_norm_w.is_floating_point() and kv_norm_w.device == kv_a.device)


@register("mla_decode_normed", "cuda", "triton_mla", _ok_mla_normed)
def _mla_normed(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale):
    from ..model import attention_ops as A
    A.validate_mla(q_lat, q_rope, kv_a, kv_cache, seq_lens, scale, prefill=False)
    A.mla_check_lengths(seq_lens, 1, kv_cache.shape[1])   # data checks (skipped in a graph capture)
    return launch.mla_decode(q_lat, q_rope, kv_a, kv_cache, seq_lens, scale, kv_norm=(kv_norm_w, eps))


def _ok_mla_uv(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale, w_uv, w_nk, gate=None):
    if not _ok_mla_normed(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale) or w_uv.dim() != 3:
        return False
    M, H, L = q_lat.shape
    V = w_uv.shape[1] if w_nk else w_uv.shape[2]
    return (w_uv.shape[0] == H and (w_uv.shape[2] if w_nk else w_uv.shape[1]) == L and w_uv.dtype == q_lat.dtype
            and (gate is None or (tuple(gate.shape) == (M, H, V) and gate.dtype == q_lat.dtype)))


@register("mla_decode_uv", "cuda", "triton_mla_uv", _ok_mla_uv)
def _mla_uv(q_lat, q_rope, kv_a, kv_norm_w, eps, kv_cache, seq_lens, scale, w_uv, w_nk, gate=None):
    from ..model import attention_ops as A
    A.validate_mla(q_lat, q_rope, kv_a, kv_cache, seq_lens, scale, prefill=False)
    A.mla_check_lengths(seq_lens, 1, kv_cache.shape[1])   # data checks (skipped in a graph capture)
    return launch.mla_decode(q_lat, q_rope, kv_a, kv_cache, seq_lens, scale, kv_norm=(kv_norm_w, eps),
                             uv=(w_uv, w_nk, gate))


def _ok_conv(xq, xk, xv, state, w):
    return launch.kda_conv_decode_fits(xq, xk, xv, state, w)


@register("kda_conv_decode", "cuda", "triton_short_conv", _ok_conv)
def _kda_conv(xq, xk, xv, state, w):
    return launch.kda_conv_decode(xq, xk, xv, state, w)


@register("kda_conv_decode_", "cuda", "triton_short_conv", _ok_conv)
def _kda_conv_inplace(xq, xk, xv, state, w):
    return launch.kda_conv_decode(xq, xk, xv, state, w, inplace=True)[:3]


def _ok_gemm(x, w):
    return x.dim() == 2 and w.dim() == 2 and x.dtype in _FLOAT and w.dtype == x.dtype


@register("decode_gemm", "cuda", "triton_mma_gemm_or_cublas", _ok_gemm)
def _decode_gemm(x, w):
    return choose.gemm("decode_gemm", x, w)   # the tuned table's kernel for (N, K, M), else torch.mm


def _ok_bmm(x, w, w_nk, gate=None):
    return (knob("decode_bmm", "1") != "0" and x.dim() == 3 and w.dim() == 3 and x.dtype in _FLOAT
            and w.dtype == x.dtype and x.shape[1] <= 16 and x.shape[0] == w.shape[0]
            and x.shape[2] == (w.shape[2] if w_nk else w.shape[1])
            and (gate is None or (gate.dtype == x.dtype
                                  and tuple(gate.shape) == (x.shape[1], x.shape[0], w.shape[1] if w_nk else w.shape[2]))))


@register("decode_bmm", "cuda", "triton_head_bmm", _ok_bmm)
def _decode_bmm(x, w, w_nk, gate=None):
    return launch.head_bmm(x, w, w_nk, gate)   # K3_KNOBS=decode_bmm=0: the op's reference (torch.bmm) instead


@register("shared_expert_async", "cuda", "side_stream")
def _shared_expert_async(x, w_gate_up, w_down, beta, linear_beta, after=None, w_up=None):
    if w_up is not None:   # separate gate and up weights: both GEMMs, then the SiTU and down GEMM, on the side stream
        return streams.fork(launch.situ_mlp2, x, w_gate_up, w_up, w_down, beta, linear_beta)
    return streams.fork(launch.situ_mlp if x.dim() == 2 else situ_mlp, x, w_gate_up, w_down, beta, linear_beta)


@register("stream_join", "cuda", "event_wait")
def _stream_join(x, after):
    streams.join(x)
    return x.clone()
