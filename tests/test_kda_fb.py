"""fold_kda_fb: the KDA gate's up-projection (f = fa @ f_b.T) folded into k3::kda_decode_fb.

- CPU: on the model's decode step the pass fires after fold_kda_gate and the compiled step equals
  eager exactly (state too); each way the gate input can differ stops the match with a reason, and
  the step stays correct. (The whole tiny model, every KDA layer matched and exact: test_cli's run
  test, which applies every pass in PASS_ORDER; the 93-layer count: test_compiler.)
- The Triton kernel (kernels/triton_kda.py) against the op's reference: in Triton's CPU interpreter
  in fp32 and fp16 (its bf16 casts truncate: 2059 of 4096 random values off by one bf16 ulp, so
  bf16 is checked on the GPU only), and on CUDA at real widths with a random state (GPU suite).
"""
from __future__ import annotations

import os

import pytest

from k3compile.config import knobs_text
import torch
import torch.nn.functional as F

import k3compile
import k3compile.ops  # noqa: F401  (registers k3::)
from k3compile.ops import reference as ref

H, K, R = 3, 16, 8


def _inputs(M=2, dtype=torch.bfloat16, device="cpu", seed=0, H=H, K=K, R=R):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    xq, xk, v = (rn(M, H, K).to(dtype) for _ in range(3))
    fa = rn(M, R).to(dtype)
    f_b = (rn(H * K, R) / R ** 0.5).to(dtype)
    b = rn(M, H).to(dtype)
    a_log, dt_bias = 0.5 * rn(H), 0.5 * rn(H * K)
    state = 0.5 * rn(M, H, K, K)
    return [x.to(device) for x in (xq, xk, v, fa, f_b, b, a_log, dt_bias, state)]


def _step(variant):
    """The model's decode step from the gate's low-rank input on (layers.KDA.forward), or one
    changed part of it."""
    def fn(xq, xk, v, fa, f_b, b, a_log, dt_bias, state):
        M = xq.shape[0]
        if variant == "bias":
            f = F.linear(fa, f_b, torch.ones(H * K, dtype=fa.dtype))
        elif variant == "weight stored [in, out]":
            f = fa @ f_b.t().contiguous()
        else:
            f = F.linear(fa, f_b)
        f3 = f.view(M, H, K).float()
        q = F.normalize(xq.float(), dim=-1) * K ** -0.5
        k = F.normalize(xk.float(), dim=-1)
        g = -5.0 * torch.sigmoid(torch.exp(a_log).view(1, H, 1) * (f3 + dt_bias.view(1, H, K)))
        o = torch.ops.k3model.kda_decode(q.to(v.dtype), k.to(v.dtype), v, g, torch.sigmoid(b.float()), state)
        return (o, f) if variant == "f read elsewhere" else o
    return fn


@pytest.mark.parametrize("variant, passes, why", [
    ("model", ("fold_kda_gate", "fold_kda_fb"), None),
    ("bias", ("fold_kda_gate", "fold_kda_fb"), "has a bias or residual"),
    ("weight stored [in, out]", ("fold_kda_gate", "fold_kda_fb"), "stored [in, out]"),
    ("f read elsewhere", ("fold_kda_gate", "fold_kda_fb"), "read elsewhere too"),
    ("model", ("fold_kda_fb",), "needs fold_kda_gate's ops"),
])
def test_fold_kda_fb_matches_the_gate_projection_or_says_why(variant, passes, why):
    args = _inputs()
    st_eager, st_comp = args[-1].clone(), args[-1].clone()
    want = _step(variant)(*args[:-1], st_eager)
    fn = torch.compile(_step(variant), backend=k3compile.backend(mode="eager", passes=list(passes)),
                       fullgraph=True, dynamic=False)
    got = fn(*args[:-1], st_comp)
    p = next(p for p in k3compile.last_report().passes if p.name == "fold_kda_fb")
    skip = why is not None and why.startswith("needs ")   # a pass it anchors on was left out
    assert p.expected == 1 and p.error is None and (p.skipped is None) != skip, p
    if skip:
        assert why in p.skipped and p.matched == 0 and not p.near_misses, p
        torch.testing.assert_close(got, want, rtol=0, atol=0)     # the graph as it was
        torch.testing.assert_close(st_comp, st_eager, rtol=0, atol=0)
    elif why is None:
        assert p.matched == 1 and not p.near_misses
        torch.testing.assert_close(got, want, rtol=0, atol=0)     # the reference is the same math
        torch.testing.assert_close(st_comp, st_eager, rtol=0, atol=0)
    else:
        assert p.matched == 0 and len(p.near_misses) == 1 and why in p.near_misses[0].reason, p.near_misses
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(st_comp, st_eager)


def test_reference_is_the_projection_then_the_gated_step():
    """k3::kda_decode_fb's reference = mm(fa, f_b.T) as [M, H, K], then kda_decode_gated: bit for bit."""
    xq, xk, v, fa, f_b, b, a_log, dt_bias, state = _inputs(M=3, seed=3)
    st1, st2 = state.clone(), state.clone()
    consts = (-5.0, K ** -0.5, 1e-12, torch.bfloat16)
    want = ref.kda_decode_gated(xq, xk, v, F.linear(fa, f_b).view(3, H, K), b, a_log, dt_bias, st1, *consts)
    got = torch.ops.k3.kda_decode_fb(xq, xk, v, fa, f_b, b, a_log, dt_bias, st2, *consts)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(st2, st1, rtol=0, atol=0)


def _err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's CPU interpreter (no-GPU machines)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, h, k, r, bv", [(3, 2, 16, 16, "32"), (2, 3, 64, 32, "16"), (1, 2, 128, 128, "32"),
                                            (2, 1, 32, 16, "64")])
def test_kernel_matches_reference_in_the_interpreter(monkeypatch, dtype, M, h, k, r, bv):
    """attention.kda_decode_fb against the op's reference, from a random state: o and the state (in
    place), within fp32 rounding (the kernel sums in another order); value blocks of 16 / 32 and one
    wider than V (the launcher takes V)."""
    pytest.importorskip("triton")
    from k3compile.kernels import attention
    monkeypatch.setenv("K3_KNOBS", knobs_text(kda_fb_bv=bv))
    xq, xk, v, fa, f_b, b, a_log, dt_bias, state = _inputs(M, dtype, seed=M + k, H=h, K=k, R=r)
    consts = (-5.0, k ** -0.5, 1e-12, dtype)
    s_ref, s_k = state.clone(), state.clone()
    assert attention.kda_decode_fb_fits(xq, xk, v, fa, f_b, b, a_log, dt_bias, s_k)
    want = ref.kda_decode_fb(xq, xk, v, fa, f_b, b, a_log, dt_bias, s_ref, *consts)
    ptr = s_k.data_ptr()
    got = attention.kda_decode_fb(xq, xk, v, fa, f_b, b, a_log, dt_bias, s_k, *consts)
    assert got.dtype == v.dtype and got.shape == want.shape and s_k.data_ptr() == ptr
    assert not torch.equal(s_k, state)
    assert _err(got, want) < 1e-5 and _err(s_k, s_ref) < 1e-5, (_err(got, want), _err(s_k, s_ref))


def test_kernel_refuses_what_it_cannot_take():
    """kda_decode_fb_fits says no (the op then runs its reference) to shapes and layouts the kernel
    does not handle."""
    from k3compile.kernels import attention
    args = _inputs()
    assert attention.kda_decode_fb_fits(*args)
    bad = {
        "K not a power of two": lambda a: [*(x[..., :12] for x in a[:3]), *a[3:]],
        "f_b of another shape": lambda a: [*a[:4], a[4][:-1], *a[5:]],
        "f_b transposed": lambda a: [*a[:4], a[4].t().contiguous().t(), *a[5:]],
        "state bf16": lambda a: [*a[:8], a[8].bfloat16()],
        "state strided": lambda a: [*a[:8], a[8].transpose(2, 3)],
        "fa of another dtype": lambda a: [*a[:3], a[3].float(), *a[4:]],
    }
    for why, change in bad.items():
        assert not attention.kda_decode_fb_fits(*change(args)), why


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 4, 16])
def test_kda_decode_fb_on_cuda_at_real_widths_eager_and_graphed(M):
    """The Triton kernel at a TP=8 rank's KDA widths (12 heads of 128, rank 128), bf16, from a random
    state, against the reference run on CPU (PyTorch's recurrence, no fla): o and the new state; then
    replayed from a CUDA graph. A wrong state element (a race, a mis-indexed tile) shows as an error
    of the order of the state itself."""
    from k3compile.kernels import dispatch
    args = _inputs(M=M, dtype=torch.bfloat16, device="cuda", seed=11 + M, H=12, K=128, R=128)
    consts = (-5.0, 128 ** -0.5, 1e-12, torch.bfloat16)
    k = dispatch.pick("kda_decode_fb", "cuda", *args, *consts)
    assert k is not None and k.name == "triton_kda_fb"
    st_ref = args[-1].cpu()
    want = ref.kda_decode_fb(*(a.cpu() for a in args[:-1]), st_ref, *consts)
    st = args[-1].clone()
    got = torch.ops.k3.kda_decode_fb(*args[:-1], st, *consts)
    # the sums' order only: f and the normed q, k can round to the neighbouring bf16 value
    assert _err(got.cpu(), want) < 1e-2 and _err(st.cpu(), st_ref) < 1e-2, (_err(got.cpu(), want), _err(st.cpu(), st_ref))
    from _cuda_graph import replay_once
    out, st_g = replay_once(lambda st: torch.ops.k3.kda_decode_fb(*args[:-1], st, *consts), args[-1])
    assert _err(out.cpu(), want) < 1e-2 and _err(st_g.cpu(), st_ref) < 1e-2
