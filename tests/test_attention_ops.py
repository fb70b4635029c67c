"""Tests for the k3model::kda_* / mla_* attention-core custom ops (k3compile/model/attention_ops.py)."""
from __future__ import annotations

import os

import pytest

from k3compile.config import knobs_text
import torch
import torch.nn.functional as F

from k3compile.model import attention_ops as ops

KDA_DECODE = torch.ops.k3model.kda_decode
KDA_PREFILL = torch.ops.k3model.kda_prefill
MLA_DECODE = torch.ops.k3model.mla_decode
MLA_PREFILL = torch.ops.k3model.mla_prefill

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------------------
# input builders
# --------------------------------------------------------------------------------------

def kda_inputs(M=2, T=None, H=3, K=8, V=6, dtype=torch.float32, device="cpu", seed=0, k_scale=1.0):
    """Inputs as the model produces them: q, k L2-normalised (q scaled by K^-0.5), log-decay
    g = -5 * sigmoid(.) (spec's gate), beta = sigmoid(.), random fp32 state [M, H, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    lead = (M, H) if T is None else (M, T, H)
    rn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = F.normalize(rn(*lead, K), dim=-1) * K ** -0.5
    k = F.normalize(rn(*lead, K), dim=-1) * k_scale
    v = rn(*lead, V)
    g = -5.0 * torch.sigmoid(rn(*lead, K) - 2.0)
    beta = torch.sigmoid(rn(*lead))
    state = 0.5 * rn(M, H, K, V)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    return [x.to(device) for x in (q, k, v, g, beta, state)]


def mla_inputs(seq_lens, T=None, H=2, L=8, R=4, S_max=12, dtype=torch.float32, device="cpu", seed=0,
               nan_fill=True):
    """Cache holds random history below seq_lens[m] and NaN garbage in the unused slots."""
    gen = torch.Generator().manual_seed(seed)
    M = len(seq_lens)
    lead = (M, H) if T is None else (M, T, H)
    q_lat = torch.randn(*lead, L, generator=gen).to(dtype)
    q_rope = torch.randn(*lead, R, generator=gen).to(dtype)
    kv_new = torch.randn(*((M,) if T is None else (M, T)), L + R, generator=gen).to(dtype)
    kv_cache = torch.randn(M, S_max, L + R, generator=gen).to(dtype)
    if nan_fill:
        for m, n in enumerate(seq_lens):
            kv_cache[m, n:] = float("nan")
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [x.to(device) for x in (q_lat, q_rope, kv_new, kv_cache, lens)]


def clone_all(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


# --------------------------------------------------------------------------------------
# naive references written from the spec's notation
# --------------------------------------------------------------------------------------

def naive_kda_decode(q, k, v, g, beta, state):
    """Spec notation, per token and head: S [V x K]; S *= decay; S += beta * (v - S k) (x) k; o = S q.

    ``state`` is in the op's (fla-core) layout [M, H, K, V], i.e. S = state[m, h].T. Returns (o fp32, new state)."""
    M, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(M, H, V)
    new_state = torch.empty_like(state, dtype=torch.float32)
    for m in range(M):
        for h in range(H):
            S = state[m, h].float().t().clone()                 # [V, K]
            qq, kk, vv = q[m, h].float(), k[m, h].float(), v[m, h].float()
            decay = torch.exp(g[m, h].float())                  # [K], decays the key dim (columns)
            b = beta[m, h].float()
            S = S * decay[None, :]
            S = S + b * torch.outer(vv - S @ kk, kk)
            o[m, h] = S @ qq
            new_state[m, h] = S.t()
    return o, new_state


def naive_mla(q_lat, q_rope, kv_new, kv_cache, seq_lens, scale):
    """Loop over sequences, new tokens and heads. Shapes with a T axis (prefill). Returns (o fp32, cache)."""
    M, T, H, L = q_lat.shape
    cache = kv_cache.clone()
    o = torch.zeros(M, T, H, L)
    for m in range(M):
        n0 = int(seq_lens[m])
        for t in range(T):
            cache[m, n0 + t] = kv_new[m, t].to(cache.dtype)
        for t in range(T):
            ctx = cache[m, : n0 + t + 1].float()
            c, kr = ctx[:, :L], ctx[:, L:]
            for h in range(H):
                s = (c @ q_lat[m, t, h].float() + kr @ q_rope[m, t, h].float()) * scale
                p = torch.softmax(s, dim=0)
                o[m, t, h] = p @ c
    return o, cache


# --------------------------------------------------------------------------------------
# KDA
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_kda_decode_matches_spec_notation(dtype):
    q, k, v, g, beta, state = kda_inputs(dtype=dtype)
    ref_o, ref_state = naive_kda_decode(q, k, v, g, beta, state)
    st = state.clone()
    o = KDA_DECODE(q, k, v, g, beta, st)
    assert o.dtype == v.dtype and o.shape == v.shape
    torch.testing.assert_close(o.float(), ref_o, **_tol(dtype))
    torch.testing.assert_close(st, ref_state, atol=1e-5, rtol=1e-5)
    # the state really changed, and K != V so a transposed layout could not even broadcast
    assert not torch.allclose(st, state)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kda_prefill_equals_repeated_decode(dtype):
    T = 5
    q, k, v, g, beta, state = kda_inputs(T=T, dtype=dtype, seed=1)
    st_p = state.clone()
    o_p = KDA_PREFILL(q, k, v, g, beta, st_p)
    assert o_p.shape == v.shape and o_p.dtype == v.dtype
    st_d = state.clone()
    o_d = torch.stack([KDA_DECODE(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], st_d) for t in range(T)], 1)
    torch.testing.assert_close(o_p, o_d, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st_p, st_d, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kda_prefill_split_equals_whole(dtype):
    T1, T2 = 3, 4
    q, k, v, g, beta, state = kda_inputs(T=T1 + T2, dtype=dtype, seed=2)
    st_w = state.clone()
    o_w = KDA_PREFILL(q, k, v, g, beta, st_w)
    st_s = state.clone()
    o_1 = KDA_PREFILL(*(x[:, :T1] for x in (q, k, v, g, beta)), st_s)
    o_2 = KDA_PREFILL(*(x[:, T1:] for x in (q, k, v, g, beta)), st_s)
    torch.testing.assert_close(torch.cat([o_1, o_2], 1), o_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st_s, st_w, atol=1e-5, rtol=1e-5)


def test_kda_mixed_input_dtypes():
    # fp32 gate / beta with bf16 q, k, v (what the model passes): output in v.dtype
    q, k, v, g, beta, state = kda_inputs(dtype=torch.bfloat16, seed=3)
    g32, b32 = g.float(), beta.float()
    o = KDA_DECODE(q, k, v, g32, b32, state.clone())
    ref_o, _ = naive_kda_decode(q, k, v, g32, b32, state)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.float(), ref_o, **_tol(torch.bfloat16))


# --------------------------------------------------------------------------------------
# MLA
# --------------------------------------------------------------------------------------

SEQ_LENS = [0, 3, 7]  # different lengths in one batch, including an empty history
SCALE = 0.37


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode_matches_naive(dtype):
    q_lat, q_rope, kv_new, kv_cache, lens = mla_inputs(SEQ_LENS, dtype=dtype)
    lens0 = lens.clone()
    cache = kv_cache.clone()
    o = MLA_DECODE(q_lat, q_rope, kv_new, cache, lens, SCALE)
    assert o.shape == q_lat.shape and o.dtype == q_lat.dtype
    ref_o, ref_cache = naive_mla(q_lat[:, None], q_rope[:, None], kv_new[:, None], kv_cache, lens, SCALE)
    torch.testing.assert_close(o.float(), ref_o[:, 0], **_tol(dtype))
    torch.testing.assert_close(cache, ref_cache, equal_nan=True, atol=0, rtol=0)
    assert torch.equal(lens, lens0)  # seq_lens is not mutated
    assert torch.isfinite(o.float()).all()  # NaN garbage in unused slots does not leak


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_prefill_matches_naive(dtype):
    T = 3
    q_lat, q_rope, kv_new, kv_cache, lens = mla_inputs(SEQ_LENS, T=T, dtype=dtype, seed=1)
    cache = kv_cache.clone()
    o = MLA_PREFILL(q_lat, q_rope, kv_new, cache, lens, SCALE)
    assert o.shape == q_lat.shape and o.dtype == q_lat.dtype
    ref_o, ref_cache = naive_mla(q_lat, q_rope, kv_new, kv_cache, lens, SCALE)
    torch.testing.assert_close(o.float(), ref_o, **_tol(dtype))
    torch.testing.assert_close(cache, ref_cache, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_prefill_then_decode_equals_token_by_token(dtype):
    T = 4
    # the T prefill tokens plus one decode token, as T + 1 token inputs
    q_lat, q_rope, kv_new, kv_cache, lens = mla_inputs(SEQ_LENS, T=T + 1, dtype=dtype, seed=2)
    lens0 = lens.clone()
    # path A: prefill T tokens, then decode the last one
    cache_a = kv_cache.clone()
    o_pre = MLA_PREFILL(q_lat[:, :T], q_rope[:, :T], kv_new[:, :T], cache_a, lens, SCALE)
    assert torch.equal(lens, lens0)
    o_dec = MLA_DECODE(q_lat[:, T], q_rope[:, T], kv_new[:, T], cache_a, lens + T, SCALE)
    o_a = torch.cat([o_pre, o_dec[:, None]], 1)
    # path B: T + 1 decode steps
    cache_b = kv_cache.clone()
    o_b = torch.stack(
        [MLA_DECODE(q_lat[:, t], q_rope[:, t], kv_new[:, t], cache_b, lens + t, SCALE) for t in range(T + 1)], 1
    )
    torch.testing.assert_close(o_a.float(), o_b.float(), **_tol(dtype))
    torch.testing.assert_close(cache_a, cache_b, equal_nan=True, atol=0, rtol=0)
    # sequences of different lengths really attended over different contexts
    ref_o, _ = naive_mla(q_lat, q_rope, kv_new, kv_cache, lens, SCALE)
    torch.testing.assert_close(o_a.float(), ref_o, **_tol(dtype))


def test_mla_int64_seq_lens_and_full_last_slot():
    # int64 lengths; one sequence fills the very last slot (seq_lens == S_max - 1 is allowed)
    S_max = 6
    q_lat, q_rope, kv_new, kv_cache, lens = mla_inputs([5, 1], S_max=S_max, seed=4)
    lens = lens.long()
    cache = kv_cache.clone()
    o = MLA_DECODE(q_lat, q_rope, kv_new, cache, lens, SCALE)
    ref_o, ref_cache = naive_mla(q_lat[:, None], q_rope[:, None], kv_new[:, None], kv_cache, lens, SCALE)
    torch.testing.assert_close(o, ref_o[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, ref_cache, equal_nan=True, atol=0, rtol=0)


# --------------------------------------------------------------------------------------
# opcheck (schema, fake impls, mutation declarations, aot dispatch)
# --------------------------------------------------------------------------------------

def _opcheck_cases():
    kd = kda_inputs(M=2, H=2, K=4, V=3)
    kp = kda_inputs(M=2, T=3, H=2, K=4, V=3)
    md = mla_inputs([1, 4], H=2, L=4, R=2, S_max=6, nan_fill=False)
    mp = mla_inputs([0, 2], T=2, H=2, L=4, R=2, S_max=6, nan_fill=False)
    return [
        ("kda_decode", KDA_DECODE, kd),
        ("kda_prefill", KDA_PREFILL, kp),
        ("mla_decode", MLA_DECODE, md + [SCALE]),
        ("mla_prefill", MLA_PREFILL, mp + [SCALE]),
    ]


@pytest.mark.parametrize("name,op,args", _opcheck_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_opcheck(name, op, args):
    torch.library.opcheck(op, tuple(args))


def test_fake_impls_shapes_on_meta():
    cases = _opcheck_cases()
    for name, op, args in cases:
        margs = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        out = op(*margs)
        assert out.device.type == "meta", name
        expected = margs[2] if name.startswith("kda") else margs[0]
        assert out.shape == expected.shape and out.dtype == expected.dtype, name


# --------------------------------------------------------------------------------------
# input validation
# --------------------------------------------------------------------------------------

def _bad_kda_decode():
    base = kda_inputs(M=2, H=2, K=4, V=3)
    q, k, v, g, beta, st = base
    return [
        ("q", [q[None], k, v, g, beta, st], "q must be 3-D"),
        ("q", [q.long(), k, v, g, beta, st], "q must be a floating-point"),
        ("k", [q, k[:, :, :3], v, g, beta, st], "k must have shape"),
        ("v", [q, k, v[:1], g, beta, st], "v must have shape"),
        ("g", [q, k, v, g[..., :2], beta, st], "g must have shape"),
        ("beta", [q, k, v, g, beta[:, :1], st], "beta must have shape"),
        ("state", [q, k, v, g, beta, st.transpose(-1, -2)], "state must have shape"),
        ("state", [q, k, v, g, beta, st.to(torch.bfloat16)], "state must be float32"),
    ]


def _bad_kda_prefill():
    q, k, v, g, beta, st = kda_inputs(M=2, T=3, H=2, K=4, V=3)
    return [
        ("q", [q[:, 0], k, v, g, beta, st], "q must be 4-D"),
        ("v", [q, k, v[:, :2], g, beta, st], "v must have shape"),
        ("beta", [q, k, v, g, beta[..., None], st], "beta must have shape"),
        ("state", [q, k, v, g, beta, st[:1]], "state must have shape"),
    ]


def _bad_mla_decode():
    ql, qr, kvn, cache, lens = mla_inputs([1, 4], H=2, L=4, R=2, S_max=6, nan_fill=False)
    return [
        ("q_lat", [ql[None], qr, kvn, cache, lens, SCALE], "q_lat must be 3-D"),
        ("q_rope", [ql, qr[:, :1], kvn, cache, lens, SCALE], "q_rope must have shape"),
        ("kv_new", [ql, qr, kvn[:, :5], cache, lens, SCALE], "kv_new must have shape"),
        ("kv_cache", [ql, qr, kvn, cache[:1], lens, SCALE], "kv_cache must have shape"),
        ("kv_cache", [ql, qr, kvn, cache[..., :5], lens, SCALE], "kv_cache must have shape"),
        ("seq_lens", [ql, qr, kvn, cache, lens[:1], SCALE], "seq_lens must have shape"),
        ("seq_lens", [ql, qr, kvn, cache, lens.float(), SCALE], "seq_lens must be an integer"),
        ("seq_lens", [ql, qr, kvn, cache, torch.tensor([1, -1], dtype=torch.int32), SCALE], "seq_lens must be >= 0"),
        ("kv_cache", [ql, qr, kvn, cache, torch.tensor([6, 0], dtype=torch.int32), SCALE], "kv_cache is full"),
    ]


def _bad_mla_prefill():
    ql, qr, kvn, cache, lens = mla_inputs([0, 2], T=3, H=2, L=4, R=2, S_max=6, nan_fill=False)
    return [
        ("q_lat", [ql[:, 0], qr, kvn, cache, lens, SCALE], "q_lat must be 4-D"),
        ("kv_new", [ql, qr, kvn[:, :2], cache, lens, SCALE], "kv_new must have shape"),
        ("kv_cache", [ql, qr, kvn, cache[:, :2], lens, SCALE], "fewer than T=3"),
        ("kv_cache", [ql, qr, kvn, cache, torch.tensor([0, 4], dtype=torch.int32), SCALE], "kv_cache is full"),
    ]


_BAD = (
    [("kda_decode", KDA_DECODE, *c) for c in _bad_kda_decode()]
    + [("kda_prefill", KDA_PREFILL, *c) for c in _bad_kda_prefill()]
    + [("mla_decode", MLA_DECODE, *c) for c in _bad_mla_decode()]
    + [("mla_prefill", MLA_PREFILL, *c) for c in _bad_mla_prefill()]
)


@pytest.mark.parametrize(
    "opname,op,argname,args,msg", _BAD, ids=[f"{b[0]}-{b[2]}-{i}" for i, b in enumerate(_BAD)]
)
def test_bad_inputs_raise(opname, op, argname, args, msg):
    args = clone_all(args)
    with pytest.raises(ValueError, match=msg) as ei:
        op(*args)
    assert argname in str(ei.value)


def test_data_dependent_checks_skipped_on_meta():
    # shape errors are still raised by the fake impl ...
    ql, qr, kvn, cache, lens = (a.to("meta") for a in mla_inputs([1, 4], H=2, L=4, R=2, S_max=6, nan_fill=False))
    with pytest.raises(ValueError, match="kv_new must have shape"):
        MLA_DECODE(ql, qr, kvn[:, :5], cache, lens, SCALE)
    # ... but the cache-full check needs values, so it does not run on meta tensors
    out = MLA_DECODE(ql, qr, kvn, cache, torch.full((2,), 99, dtype=torch.int32, device="meta"), SCALE)
    assert out.shape == ql.shape


# --------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------

def test_ops_inside_torch_compile():
    kd = kda_inputs(M=2, H=2, K=4, V=3, seed=5)
    kp = kda_inputs(M=2, T=3, H=2, K=4, V=3, seed=6)
    md = mla_inputs([1, 4], H=2, L=4, R=2, S_max=8, seed=7)
    mp = mla_inputs([1, 4], T=2, H=2, L=4, R=2, S_max=8, seed=8)

    def f(kd, kp, md, mp, state, cache):
        o1 = torch.ops.k3model.kda_prefill(*kp, state)
        o2 = torch.ops.k3model.kda_decode(*kd, state)
        ql, qr, kvn, lens = mp
        o3 = torch.ops.k3model.mla_prefill(ql, qr, kvn, cache, lens, SCALE)
        ql, qr, kvn, _ = md
        o4 = torch.ops.k3model.mla_decode(ql, qr, kvn, cache, lens + 2, SCALE)
        return o1.sum(1) * 2 + o2, o3.sum(1) + o4

    def run(fn):
        state, cache = kd[5].clone(), mp[3].clone()
        outs = fn(kd[:5], kp[:5], md[:3] + [md[4]], [mp[0], mp[1], mp[2], mp[4]], state, cache)
        return outs, state, cache

    (e1, e2), e_state, e_cache = run(f)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    (c1, c2), c_state, c_cache = run(compiled)
    torch.testing.assert_close(c1, e1)
    torch.testing.assert_close(c2, e2)
    # the in-place state / cache updates are visible after the compiled call
    assert not torch.allclose(c_state, kd[5])
    torch.testing.assert_close(c_state, e_state)
    torch.testing.assert_close(c_cache, e_cache, equal_nan=True)


# --------------------------------------------------------------------------------------
# GPU: fla-core chunk_kda vs the reference, and all ops on CUDA vs CPU
# --------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


@pytest.mark.gpu
@needs_cuda
# Each (dtype, K, V) compiles and autotunes chunk_kda's kernels anew (minutes on the first GPU run),
# so the cases are picked, not crossed: both dtypes, both head shapes, one token, a partial chunk
# and more than two chunks of 64.
@pytest.mark.parametrize("dtype,K,V,T", [(torch.bfloat16, 128, 128, 130), (torch.bfloat16, 128, 128, 1),
                                         (torch.float32, 64, 32, 37)])
def test_fla_chunk_kda_matches_reference(dtype, K, V, T):
    if not ops._fla_chunk_kda_available():
        msg = "fla-core (fla.ops.kda.chunk_kda) is not importable / has an unexpected API"
        if os.environ.get("K3_REQUIRE_FLA", "0") not in ("", "0"):
            pytest.fail(msg)
        pytest.skip(msg)
    # k scaled to norm 0.8 so an accidental in-kernel L2 norm of k (or of q: |q| = K^-0.5) shows up
    q, k, v, g, beta, state = kda_inputs(M=2, T=T, H=4, K=K, V=V, dtype=dtype, device="cuda", seed=11,
                                         k_scale=0.8)
    assert ops._fla_fits(q, k, v, g, beta, state)
    st_ref, st_fla = state.clone(), state.clone()
    o_ref = ops.kda_prefill_reference(q, k, v, g, beta, st_ref)
    o_fla = ops._kda_prefill_fla(q, k, v, g, beta, st_fla)
    tol = 5e-3 if dtype == torch.float32 else 3e-2
    assert o_fla.shape == o_ref.shape and o_fla.dtype == v.dtype
    print(f"fla vs reference {dtype} K={K} V={V} T={T}: rel err o {_rel_err(o_fla, o_ref):.2e}, "
          f"state {_rel_err(st_fla, st_ref):.2e}")
    assert _rel_err(o_fla, o_ref) < tol, f"output rel err {_rel_err(o_fla, o_ref):.3g}"
    assert _rel_err(st_fla, st_ref) < tol, f"state rel err {_rel_err(st_fla, st_ref):.3g}"
    # the op dispatches to fla on CUDA and gives the same answer
    st_op = state.clone()
    o_op = KDA_PREFILL(q, k, v, g, beta, st_op)
    assert _rel_err(o_op, o_ref) < tol and _rel_err(st_op, st_ref) < tol
    # the check above is sharp: each plausible convention mistake moves the result far beyond tol
    wrong = {
        "default scale K^-0.5 applied again": (q * K ** -0.5, k, v, g, beta, state),
        "q/k L2-normalised in kernel": (
            F.normalize(q.float(), dim=-1).to(dtype), F.normalize(k.float(), dim=-1).to(dtype), v, g, beta, state
        ),
        "gate read as log2": (q, k, v, g * 1.4426950408889634, beta, state),
        "beta sigmoided again": (q, k, v, g, torch.sigmoid(beta.float()).to(dtype), state),
    }
    if K == V:
        wrong["state transposed [V, K]"] = (q, k, v, g, beta, state.transpose(-1, -2).contiguous())
    for what, args in wrong.items():
        st_w = args[5].clone()
        o_w = ops.kda_prefill_reference(*args[:5], st_w)
        err = max(_rel_err(o_w, o_ref), _rel_err(st_w, st_ref))
        assert err > 2 * tol, f"test would not detect: {what} (err {err:.3g})"


_FLA_DECODE_CPU = """
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.environ["K3_TESTS"])
from test_attention_ops import kda_inputs
from k3compile.model import attention_ops as ops
worst = 0.0
assert ops.fla_fused_recurrent_kda_fwd() is not None  # fla 0.6: the in-place step
for dtype, K, V in ((torch.float32, 16, 16), (torch.float32, 32, 8), (torch.float16, 16, 16)):
    q, k, v, g, beta, state = kda_inputs(M=3, H=2, K=K, V=V, dtype=dtype, seed=K + V, k_scale=0.8)
    st_ref = state.clone()
    o_ref = ops.kda_decode_reference(q, k, v, g, beta, st_ref)
    # contiguous state: updated in place by the kernel; a strided one: the public API and a copy back
    for st_fla in (state.clone(), state.transpose(-1, -2).contiguous().transpose(-1, -2)):
        ptr = st_fla.data_ptr()
        o_fla = ops._kda_decode_fla(q, k, v, g, beta, st_fla)
        assert o_fla.dtype == v.dtype and o_fla.shape == o_ref.shape and st_fla.data_ptr() == ptr
        for a, b in ((o_fla, o_ref), (st_fla, st_ref)):
            worst = max(worst, ((a.float() - b.float()).abs().max() / b.float().abs().max()).item())
print(worst)
"""


def test_fla_decode_matches_reference_in_the_triton_interpreter():
    """The decode path on CUDA (K3_KNOBS=fla_decode=1, the default): fla-core's fused_recurrent_kda with our
    conventions (layout, K-major state, log decay, scale 1, no in-kernel norms) equals the
    reference recurrence, output and state, run by Triton's CPU interpreter. Skipped where fla-core
    is not installed (CI); `pip install fla-core einops` runs it."""
    import subprocess
    import sys
    env = dict(os.environ, K3_KNOBS="fla_decode=1", K3_TESTS=os.path.dirname(os.path.abspath(__file__)))
    probe = subprocess.run([sys.executable, "-c", "import fla.ops.kda, einops"], env=env, capture_output=True)
    if probe.returncode:
        pytest.skip("fla-core (and einops) not installed")
    r = subprocess.run([sys.executable, "-c", _FLA_DECODE_CPU], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert float(r.stdout.split()[-1]) < 2e-3, r.stdout


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_fla_decode_matches_reference_on_cuda(dtype, monkeypatch):
    """K3_KNOBS=fla_decode=1 on CUDA: the decode op runs fla's fused_recurrent_kda, equal to the
    reference (output and state), also when replayed from a CUDA graph."""
    monkeypatch.setenv("K3_KNOBS", knobs_text(fla_decode="1"))
    ops.fla_fused_recurrent_kda.cache_clear()
    try:
        if ops.fla_fused_recurrent_kda() is None:
            msg = "fla-core (fla.ops.kda.fused_recurrent_kda) is not importable / has an unexpected API"
            if os.environ.get("K3_REQUIRE_FLA", "0") not in ("", "0"):
                pytest.fail(msg)
            pytest.skip(msg)
        q, k, v, g, beta, state = kda_inputs(M=4, H=4, K=128, V=128, dtype=dtype, device="cuda", seed=21,
                                             k_scale=0.8)
        assert ops._fla_decode_fits(q, k, v, g, beta, state)
        st_ref, st_op = state.clone(), state.clone()
        o_ref = ops.kda_decode_reference(q, k, v, g, beta, st_ref)
        o_op = KDA_DECODE(q, k, v, g, beta, st_op)
        tol = 5e-3 if dtype == torch.float32 else 3e-2
        assert _rel_err(o_op, o_ref) < tol and _rel_err(st_op, st_ref) < tol
        st_g = state.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_g = KDA_DECODE(q, k, v, g, beta, st_g)
        st_g.copy_(state)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(o_g, o_ref) < tol and _rel_err(st_g, st_ref) < tol
    finally:
        ops.fla_fused_recurrent_kda.cache_clear()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_on_cuda_match_cpu(dtype):
    tol = _tol(dtype) if dtype == torch.bfloat16 else dict(atol=2e-3, rtol=2e-3)
    # same M, H, K, V as the fla test above so fla's autotuning (about a minute per new shape) is reused
    kd = kda_inputs(M=2, H=4, K=64, V=32, dtype=dtype, seed=12)
    kp = kda_inputs(M=2, T=70, H=4, K=64, V=32, dtype=dtype, seed=13)
    for op, args in ((KDA_DECODE, kd), (KDA_PREFILL, kp)):
        st_c, st_g = args[5].clone(), args[5].cuda()
        o_c = op(*args[:5], st_c)
        o_g = op(*(a.cuda() for a in args[:5]), st_g)
        pt = tol if op is KDA_DECODE else dict(atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(o_g.cpu().float(), o_c.float(), **pt)
        torch.testing.assert_close(st_g.cpu(), st_c, **pt)
    md = mla_inputs(SEQ_LENS, dtype=dtype, seed=14)
    mp = mla_inputs(SEQ_LENS, T=3, dtype=dtype, seed=15)
    for op, args in ((MLA_DECODE, md), (MLA_PREFILL, mp)):
        c_c, c_g = args[3].clone(), args[3].cuda()
        o_c = op(args[0], args[1], args[2], c_c, args[4], SCALE)
        o_g = op(args[0].cuda(), args[1].cuda(), args[2].cuda(), c_g, args[4].cuda(), SCALE)
        torch.testing.assert_close(o_g.cpu().float(), o_c.float(), **tol)
        torch.testing.assert_close(c_g.cpu(), c_c, equal_nan=True, atol=0, rtol=0)


def test_fla_decode_is_on_by_default_when_importable(monkeypatch):
    """fla's decode kernel is used wherever fla-core imports with the keyword API we pass (checked
    on the H200); K3_KNOBS=fla_decode=0 turns the decode one off, K3_KNOBS=disable_fla=1 both."""
    import sys
    import types

    def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, **kw):
        raise AssertionError("not called here")
    fla, fops, fkda = (types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.kda"))
    fkda.fused_recurrent_kda = fused_recurrent_kda
    fla.ops, fops.kda = fops, fkda
    monkeypatch.setitem(sys.modules, "fla", fla)
    monkeypatch.setitem(sys.modules, "fla.ops", fops)
    monkeypatch.setitem(sys.modules, "fla.ops.kda", fkda)
    for env, want in (({}, True), ({"K3_KNOBS": "fla_decode=0"}, False), ({"K3_KNOBS": "disable_fla=1"}, False)):
        for k in ("K3_KNOBS",):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        ops.fla_fused_recurrent_kda.cache_clear()
        try:
            assert (ops.fla_fused_recurrent_kda() is fused_recurrent_kda) == want, env
        finally:
            ops.fla_fused_recurrent_kda.cache_clear()
