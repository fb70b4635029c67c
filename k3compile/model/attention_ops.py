"""Attention "cores" of the Kimi K3 decoder as opaque custom ops (namespace ``k3model``).

The model calls these so that torch.compile sees each attention core as one node
(../shared/K3-SPEC.md, section 2). Each op has:

* a plain-PyTorch reference implementation (CPU and CUDA, fp32 math),
* a fake implementation (shapes / dtypes only) for tracing,
* input validation raising ``ValueError`` that names the offending argument.
  Data-dependent checks (cache overflow) run only on real tensors, never in the
  fake impl, on meta tensors or while a CUDA graph is being captured.

Ops (all return a fresh tensor; the cache / state argument is mutated in place):

``k3model::kda_decode(q, k, v, g, beta, state) -> Tensor``  mutates ``state``
    q, k, g [M, H, K]; v [M, H, V]; beta [M, H]; state [M, H, K, V] fp32.
    q, k are already L2-normalised and q already scaled; g is the log-decay
    (decay = exp(g)); beta is already sigmoided. Per (m, h), in fp32, with the
    state stored K-major ("fla-core layout", S[k, v]):
        S = S * exp(g)[:, None]
        S = S + beta * outer(k, v - k @ S)
        o = q @ S                                  -> [M, H, V] in v.dtype
    (In the spec's notation with S' = S^T of shape [V, K]:
    ``S' *= decay; S' += beta * (v - S' k) (x) k; o = S' q``.)

    On CUDA it runs fla-core's ``fused_recurrent_kda`` when importable (equal to the reference on
    the H200 and in Triton's CPU interpreter; K3_KNOBS=fla_decode=0 or K3_KNOBS=disable_fla=1 turn it off).

``k3model::kda_prefill(q, k, v, g, beta, state) -> Tensor``  mutates ``state``
    q, k, g [M, T, H, K]; v [M, T, H, V]; beta [M, T, H]. The recurrence over T,
    starting from ``state``; the final state is left in ``state``. Returns
    [M, T, H, V] in v.dtype. On CUDA it dispatches to fla-core's ``chunk_kda``
    when available (see ``_fla_chunk_kda_available``).

``k3model::mla_decode(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale) -> Tensor``  mutates ``kv_cache``
    q_lat [M, H, L]; q_rope [M, H, R]; kv_new [M, L+R] (c_kv then k_rope);
    kv_cache [M, S_max, L+R]; seq_lens [M] int (tokens already cached; not mutated).
    Writes kv_new at position seq_lens[m], attends over 0..seq_lens[m] inclusive:
    scores = (q_lat . c + q_rope . k_rope) * scale, fp32 softmax, o = p @ c.
    Returns [M, H, L] in q_lat.dtype.

``k3model::mla_prefill(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale) -> Tensor``  mutates ``kv_cache``
    Same with T new tokens: q_lat [M, T, H, L], q_rope [M, T, H, R], kv_new [M, T, L+R];
    writes positions seq_lens[m] .. seq_lens[m]+T-1; token t attends causally to
    positions 0 .. seq_lens[m]+t. Returns [M, T, H, L].
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os

import torch

__all__ = [
    "kda_decode",
    "kda_prefill",
    "mla_decode",
    "mla_prefill",
    "kda_decode_reference",
    "kda_prefill_reference",
    "mla_decode_reference",
    "mla_prefill_reference",
]


# --------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------

def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_float(name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def _check_dim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {list(t.shape)}")


def _check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], layout: str) -> None:
    if _shape(t) != tuple(expected):
        raise ValueError(f"{name} must have shape {layout} = {list(expected)}, got {list(t.shape)}")


def _check_same_device(named: dict[str, torch.Tensor]) -> None:
    items = list(named.items())
    ref_name, ref = items[0]
    for name, t in items[1:]:
        if t.device != ref.device:
            raise ValueError(
                f"{name} is on {t.device} but {ref_name} is on {ref.device}; all inputs must share a device"
            )


try:  # FakeTensor is private API; only used to skip data checks, never required.
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except Exception:  # pragma: no cover
    _FakeTensor = None


def _data_checks_allowed(*tensors: torch.Tensor) -> bool:
    """True when it is safe and meaningful to read tensor values (no fake/meta, no graph capture)."""
    for t in tensors:
        if t.device.type == "meta":
            return False
        if _FakeTensor is not None and isinstance(t, _FakeTensor):
            return False
    if any(t.is_cuda for t in tensors):
        try:
            if torch.cuda.is_current_stream_capturing():
                return False
        except Exception:  # pragma: no cover
            pass
    return True


# --------------------------------------------------------------------------------------
# KDA
# --------------------------------------------------------------------------------------

def _validate_kda(q, k, v, g, beta, state, *, prefill: bool) -> None:
    if prefill:
        nd, qk_lay, v_lay, b_lay = 4, "[M, T, H, K]", "[M, T, H, V]", "[M, T, H]"
    else:
        nd, qk_lay, v_lay, b_lay = 3, "[M, H, K]", "[M, H, V]", "[M, H]"
    _check_dim("q", q, nd, qk_lay)
    _check_shape("k", k, _shape(q), qk_lay)
    _check_dim("v", v, nd, v_lay)
    if _shape(v)[:-1] != _shape(q)[:-1]:
        raise ValueError(
            f"v must have shape {v_lay} matching q's leading dims {list(q.shape[:-1])}, got {list(v.shape)}"
        )
    _check_shape("g", g, _shape(q), qk_lay)
    _check_shape("beta", beta, _shape(q)[:-1], b_lay)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_float(name, t)
    if prefill:
        M, _T, H, K = q.shape
    else:
        M, H, K = q.shape
    V = v.shape[-1]
    _check_shape("state", state, (M, H, K, V), "[M, H, K, V]")
    if state.dtype != torch.float32:
        raise ValueError(f"state must be float32 (the recurrent state is kept in fp32), got {state.dtype}")
    _check_same_device({"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state})


def _kda_step(S: torch.Tensor, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrence step. S [M, H, K, V] fp32; q, k, g [M, H, K]; v [M, H, V]; beta [M, H].

    Returns (o [M, H, V] fp32, new S)."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = S * torch.exp(g).unsqueeze(-1)                              # decay along K
    kS = torch.einsum("mhk,mhkv->mhv", k, S)                         # k @ S  (= S'k)
    u = beta.unsqueeze(-1) * (v - kS)                                # [M, H, V]
    S = S + k.unsqueeze(-1) * u.unsqueeze(-2)                        # outer(k, u)
    o = torch.einsum("mhk,mhkv->mhv", q, S)                          # q @ S  (= S'q)
    return o, S


def kda_decode_reference(q, k, v, g, beta, state) -> torch.Tensor:
    """Reference math for kda_decode (mutates ``state``)."""
    o, S = _kda_step(state.float(), q, k, v, g, beta)
    state.copy_(S)
    return o.to(v.dtype)


def kda_prefill_reference(q, k, v, g, beta, state) -> torch.Tensor:
    """Reference math for kda_prefill: a loop over T of the decode step (mutates ``state``)."""
    M, T, H, _K = q.shape
    V = v.shape[-1]
    out = torch.empty(M, T, H, V, dtype=v.dtype, device=v.device)
    S = state.float()
    for t in range(T):
        o, S = _kda_step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        out[:, t] = o.to(v.dtype)
    state.copy_(S)
    return out


_FLA_KWARGS = {"scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
               "use_gate_in_kernel", "use_beta_sigmoid_in_kernel"}


def _fla_kda(name: str, needed: set):
    """fla-core's ``fla.ops.kda.<name>`` if importable with the keywords we pass; None if not, or
    with K3_KNOBS disable_fla set."""
    from ..config import knob
    if knob("disable_fla", "0") != "0":
        return None
    try:
        import fla.ops.kda  # noqa: PLC0415
        fn = getattr(fla.ops.kda, name)
        params = _fla_params(fn)
    except Exception:
        return None
    return fn if needed.issubset(params) else None


@functools.lru_cache(maxsize=None)
def _fla_params(fn) -> frozenset:
    """The keyword names an fla function takes (inspected once, not on every call)."""
    return frozenset(inspect.signature(fn).parameters)


def fla_qkv(q, k, v) -> tuple:
    """q, k, v in their common float dtype (fp32 for any other), contiguous: what fla's kernels take."""
    cdt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    if cdt not in (torch.bfloat16, torch.float16, torch.float32):
        cdt = torch.float32
    return tuple(x.to(cdt).contiguous() for x in (q, k, v))


def _fla_args(fn, q, k, v, g, beta, state) -> tuple[tuple, dict]:
    """(positional, keyword) arguments of an fla KDA kernel for our conventions (``_kda_prefill_fla``'s
    docstring): q, k, v in their common float dtype, fp32 g and beta, all contiguous; scale 1.0, our
    state as the initial state (K-major), no in-kernel norms, gate or beta sigmoid."""
    args = (*fla_qkv(q, k, v), g.to(torch.float32).contiguous(), beta.to(torch.float32).contiguous())
    kwargs = dict(scale=1.0, initial_state=state.contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=False,
                  use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False)
    params = _fla_params(fn)
    if "state_v_first" in params:
        kwargs["state_v_first"] = False
    if "safe_gate" in params:
        kwargs["safe_gate"] = False  # our g is not guaranteed to be bounded
    return args, kwargs


@functools.lru_cache(maxsize=None)
def _fla_chunk_kda():
    """Import fla-core's ``chunk_kda`` and check it has the keyword API we rely on; None if not."""
    return _fla_kda("chunk_kda", _FLA_KWARGS | {"cu_seqlens"})


def _fla_chunk_kda_available() -> bool:
    """True when fla-core's KDA chunk kernel can be used (importable, known API, CUDA present)."""
    return torch.cuda.is_available() and _fla_chunk_kda() is not None


def _fla_fits(q, k, v, g, beta, state) -> bool:
    K = q.shape[-1]
    return (
        q.is_cuda
        and q.shape[1] > 0            # T > 0
        and q.shape[0] > 0            # M > 0
        and K <= 256                  # chunk_kda limit (asserted there)
        and state.dtype == torch.float32
        and _fla_chunk_kda_available()
    )


def _kda_prefill_fla(q, k, v, g, beta, state) -> torch.Tensor:
    """kda_prefill through fla-core 0.6 ``chunk_kda``. Mutates ``state``.

    Convention mapping (fla-core 0.6.0, fla/ops/kda/chunk.py):
      * layout: fla is "[B, T, H, K]" (time-major, not head-first) = ours with B = M.
      * state: fla ``initial_state`` / final state are [N, HV, K, V] fp32 with the default
        ``state_v_first=False`` (K-major) = ours [M, H, K, V]. We pass state_v_first=False explicitly.
      * gate: with ``use_gate_in_kernel=False`` fla takes ``g`` as the natural-log per-step decay
        (it rescales to log2 internally: chunk_local_cumsum(g, scale=RCP_LN2)) = ours.
      * scale: fla multiplies q by ``scale`` (default K**-0.5); our q is already scaled -> scale=1.0.
      * normalisation: ``use_qk_l2norm_in_kernel=False`` (ours are already normalised).
      * beta: ``use_beta_sigmoid_in_kernel=False`` (ours is post-sigmoid).
      * output: fla returns ``o.type_as(q)``; we cast to v.dtype.
    """
    chunk_kda = _fla_chunk_kda()
    args, kwargs = _fla_args(chunk_kda, q, k, v, g, beta, state)
    with torch.no_grad():
        res = chunk_kda(*args, cu_seqlens=None, **kwargs)
    o, final_state = res[0], res[1]
    if final_state is None or _shape(final_state) != _shape(state):
        raise RuntimeError(
            f"fla chunk_kda returned a final state of shape "
            f"{None if final_state is None else list(final_state.shape)}, expected {list(state.shape)}"
        )
    if _shape(o) != (*q.shape[:-1], v.shape[-1]):
        raise RuntimeError(
            f"fla chunk_kda returned o of shape {list(o.shape)}, expected {[*q.shape[:-1], v.shape[-1]]}"
        )
    state.copy_(final_state)
    return o.to(v.dtype)


@functools.lru_cache(maxsize=None)
def fla_fused_recurrent_kda():
    """Import fla-core's decode kernel ``fused_recurrent_kda`` and check its keyword API; None if
    not, or with K3_KNOBS=fla_decode=0 (decode only) / K3_KNOBS=disable_fla=1 (prefill too). Checked against the
    reference on the H200 (eagerly and graphed, fp32 and bf16) and in Triton's CPU interpreter."""
    from ..config import knob
    if knob("fla_decode", "1") == "0":
        return None
    return _fla_kda("fused_recurrent_kda", _FLA_KWARGS)


@functools.lru_cache(maxsize=None)
def fla_fused_recurrent_kda_fwd():
    """fla-core's ``fused_recurrent_kda_fwd`` if it takes the keywords of an in-place decode step
    (``inplace_final_state``, ``out``); None if not. The public ``fused_recurrent_kda`` allocates a
    new final state (which we then copy back: the whole [M, H, K, V] fp32 state, 50 MB at M=64 with
    TP=8 shapes) and zero-fills the output; this writes the state in place and the output into an
    uninitialised buffer the kernel fills."""
    try:
        from fla.ops.kda import fused_recurrent  # noqa: PLC0415
        fn = fused_recurrent.fused_recurrent_kda_fwd
        params = _fla_params(fn)
    except Exception:
        return None
    return fn if (_FLA_KWARGS | {"inplace_final_state", "out"}).issubset(params) else None


def fla_decode_in_place(args: tuple, kwargs: dict, state: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """One ``fused_recurrent_kda_fwd`` step (T = 1) on the [M, 1, H, *] `args` (q, k, v, g, beta)
    with the kernel keywords `kwargs`: the contiguous K-major fp32 `state` is read and written in
    place (each (token, head, V block) by one program), the output goes into an empty buffer the
    kernel fills. Returns o [M, H, V] in out_dtype. Used by kda_decode and by k3's
    kda_decode_gated (kernels/attention.py), which puts the norms and the gate in the kernel."""
    fwd = fla_fused_recurrent_kda_fwd()
    kwargs = dict(kwargs, initial_state=state, output_final_state=True)
    if "state_v_first" in _fla_params(fwd):
        kwargs["state_v_first"] = False
    out = torch.empty_like(args[2])
    dev = args[0].device
    with torch.no_grad(), (torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()):
        o, final_state = fwd(*args, out=out, inplace_final_state=True, **kwargs)[:2]
    if final_state is not state or o is not out:
        raise RuntimeError("fla fused_recurrent_kda_fwd did not update the state in place / fill `out`")
    return o[:, 0].to(out_dtype)


def _fla_decode_fits(q, k, v, g, beta, state) -> bool:
    return (q.is_cuda and q.shape[0] > 0 and q.shape[-1] <= 256 and state.dtype == torch.float32
            and fla_fused_recurrent_kda() is not None)


def _kda_decode_fla(q, k, v, g, beta, state) -> torch.Tensor:
    """kda_decode through fla-core 0.6 ``fused_recurrent_kda`` with T = 1 (one Triton kernel for the
    decay, the delta-rule update and the read-out). Mutates ``state``. The conventions are the
    prefill's (``_kda_prefill_fla``): [B, T, H, K] layout with B = M, K-major fp32 state, natural-log
    decay, scale 1.0, no in-kernel norms or beta sigmoid; output cast to v.dtype."""
    fused_recurrent_kda = fla_fused_recurrent_kda()
    args, kwargs = _fla_args(fused_recurrent_kda, *(x.unsqueeze(1) for x in (q, k, v, g, beta)), state)  # T = 1
    if fla_fused_recurrent_kda_fwd() is not None and state.is_contiguous():
        return fla_decode_in_place(args, kwargs, state, v.dtype)
    with torch.no_grad():
        o, final_state = fused_recurrent_kda(*args, **kwargs)[:2]
    if final_state is None or _shape(final_state) != _shape(state) or _shape(o) != (q.shape[0], 1, *v.shape[1:]):
        raise RuntimeError(f"fla fused_recurrent_kda returned o {list(o.shape)} and final state "
                           f"{None if final_state is None else list(final_state.shape)}; expected "
                           f"{[q.shape[0], 1, *v.shape[1:]]} and {list(state.shape)}")
    state.copy_(final_state)
    return o[:, 0].to(v.dtype)


@torch.library.custom_op("k3model::kda_decode", mutates_args=("state",))
def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    _validate_kda(q, k, v, g, beta, state, prefill=False)
    if _fla_decode_fits(q, k, v, g, beta, state):
        return _kda_decode_fla(q, k, v, g, beta, state)
    return kda_decode_reference(q, k, v, g, beta, state)


@kda_decode.register_fake
def _kda_decode_fake(q, k, v, g, beta, state):
    _validate_kda(q, k, v, g, beta, state, prefill=False)
    return v.new_empty(v.shape)


@torch.library.custom_op("k3model::kda_prefill", mutates_args=("state",))
def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    _validate_kda(q, k, v, g, beta, state, prefill=True)
    if _fla_fits(q, k, v, g, beta, state):
        return _kda_prefill_fla(q, k, v, g, beta, state)
    return kda_prefill_reference(q, k, v, g, beta, state)


@kda_prefill.register_fake
def _kda_prefill_fake(q, k, v, g, beta, state):
    _validate_kda(q, k, v, g, beta, state, prefill=True)
    return v.new_empty(v.shape)


# --------------------------------------------------------------------------------------
# MLA
# --------------------------------------------------------------------------------------

def validate_mla(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale, *, prefill: bool) -> None:
    if prefill:
        nd, ql_lay, qr_lay, kv_lay = 4, "[M, T, H, L]", "[M, T, H, R]", "[M, T, L+R]"
    else:
        nd, ql_lay, qr_lay, kv_lay = 3, "[M, H, L]", "[M, H, R]", "[M, L+R]"
    _check_dim("q_lat", q_lat, nd, ql_lay)
    _check_dim("q_rope", q_rope, nd, qr_lay)
    if _shape(q_rope)[:-1] != _shape(q_lat)[:-1]:
        raise ValueError(
            f"q_rope must have shape {qr_lay} matching q_lat's leading dims {list(q_lat.shape[:-1])}, "
            f"got {list(q_rope.shape)}"
        )
    L, R = q_lat.shape[-1], q_rope.shape[-1]
    lead = _shape(q_lat)[:-2]  # (M,) or (M, T)
    M = lead[0]
    _check_shape("kv_new", kv_new, (*lead, L + R), kv_lay)
    _check_dim("kv_cache", kv_cache, 3, "[M, S_max, L+R]")
    if kv_cache.shape[0] != M or kv_cache.shape[2] != L + R:
        raise ValueError(
            f"kv_cache must have shape [M, S_max, L+R] = [{M}, S_max, {L + R}], got {list(kv_cache.shape)}"
        )
    if prefill and kv_cache.shape[1] < lead[1]:
        raise ValueError(f"kv_cache has S_max={kv_cache.shape[1]} slots, fewer than T={lead[1]} new tokens")
    _check_shape("seq_lens", seq_lens, (M,), "[M]")
    if seq_lens.is_floating_point() or seq_lens.is_complex() or seq_lens.dtype == torch.bool:
        raise ValueError(f"seq_lens must be an integer tensor, got dtype {seq_lens.dtype}")
    for name, t in (("q_lat", q_lat), ("q_rope", q_rope), ("kv_new", kv_new), ("kv_cache", kv_cache)):
        _check_float(name, t)
    if isinstance(scale, bool) or not isinstance(scale, (float, int, torch.SymFloat, torch.SymInt)):
        raise ValueError(f"scale must be a float, got {type(scale).__name__}")
    _check_same_device({"q_lat": q_lat, "q_rope": q_rope, "kv_new": kv_new, "kv_cache": kv_cache, "seq_lens": seq_lens})


def mla_check_lengths(seq_lens: torch.Tensor, T: int, S_max: int) -> int | None:
    """Data-dependent checks. Returns the number of cache positions needed (max end), or None if skipped."""
    if not _data_checks_allowed(seq_lens):
        return None
    if seq_lens.numel() == 0:
        return 0
    lo = int(seq_lens.min())
    hi = int(seq_lens.max())
    if lo < 0:
        raise ValueError(f"seq_lens must be >= 0, got min {lo}")
    if hi + T > S_max:
        if T == 1:
            raise ValueError(
                f"kv_cache is full: seq_lens has {hi} cached tokens but S_max={S_max}; "
                f"seq_lens[m] must be < S_max to append a token"
            )
        raise ValueError(
            f"kv_cache is full: seq_lens max {hi} + T={T} new tokens exceeds S_max={S_max}"
        )
    return hi + T


def mla_core(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale) -> torch.Tensor:
    """Batched reference. q_lat [M, T, H, L], q_rope [M, T, H, R], kv_new [M, T, L+R]. Mutates kv_cache."""
    M, T, H, L = q_lat.shape
    S_max = kv_cache.shape[1]
    dev = kv_cache.device
    n = mla_check_lengths(seq_lens, T, S_max)
    lens = seq_lens.to(device=dev, dtype=torch.long)
    if M == 0 or T == 0:
        return q_lat.new_empty(q_lat.shape)
    # write the new tokens: kv_cache[m, lens[m] + t] = kv_new[m, t]
    pos = lens[:, None] + torch.arange(T, device=dev)[None, :]                       # [M, T]
    rows = torch.arange(M, device=dev)[:, None].expand(M, T)
    kv_cache.index_put_((rows, pos), kv_new.to(kv_cache.dtype))
    # attend over the first n positions (n = max end when known, else all of S_max)
    n = S_max if n is None else n
    kv = kv_cache[:, :n].float()
    # zero the slots past each sequence's end so garbage (even NaN/inf) in unused cache slots cannot leak
    # through 0 * garbage in the weighted sum; their scores are masked to -inf below as well.
    in_seq = torch.arange(n, device=dev)[None, :] < (lens + T)[:, None]               # [M, n]
    kv = kv.masked_fill(~in_seq[:, :, None], 0.0)
    c, kr = kv[..., :L], kv[..., L:]                                                  # [M, n, L], [M, n, R]
    scores = torch.einsum("mthl,msl->mths", q_lat.float(), c)
    scores = scores + torch.einsum("mthr,msr->mths", q_rope.float(), kr)
    scores = scores * float(scale)
    visible = torch.arange(n, device=dev)[None, None, :] <= pos[:, :, None]          # [M, T, n]
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    o = torch.einsum("mths,msl->mthl", p, c)
    return o.to(q_lat.dtype)


def mla_decode_reference(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale) -> torch.Tensor:
    """Reference math for mla_decode (mutates ``kv_cache``)."""
    return mla_core(q_lat[:, None], q_rope[:, None], kv_new[:, None], kv_cache, seq_lens, scale)[:, 0]


def mla_prefill_reference(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale) -> torch.Tensor:
    """Reference math for mla_prefill (mutates ``kv_cache``)."""
    return mla_core(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale)


@torch.library.custom_op("k3model::mla_decode", mutates_args=("kv_cache",))
def mla_decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_new: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    validate_mla(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale, prefill=False)
    return mla_decode_reference(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale)


@mla_decode.register_fake
def _mla_decode_fake(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale):
    validate_mla(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale, prefill=False)
    return q_lat.new_empty(q_lat.shape)


@torch.library.custom_op("k3model::mla_prefill", mutates_args=("kv_cache",))
def mla_prefill(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_new: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    validate_mla(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale, prefill=True)
    return mla_prefill_reference(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale)


@mla_prefill.register_fake
def _mla_prefill_fake(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale):
    validate_mla(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale, prefill=True)
    return q_lat.new_empty(q_lat.shape)
