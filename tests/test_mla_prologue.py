"""fold_mla_prologue: the MLA decode step's kv_a RMSNorm (and the q_rope copy) folded into
k3::mla_decode_normed; fold_mla_output: its split combine and value up-projection (with the
output gate) in k3::mla_decode_uv.

- CPU: on the model's prologue math the pass fires and the compiled step equals eager exactly
  (the cache too); each way the prologue can differ from K3's stops the match with a reason that
  names it, and the step stays correct; the same for fold_mla_output on the model's attention
  output path. (The whole-model site counts and the compile-vs-eager equality at TP 1 / 2, dynamic
  M included, are in test_compiler.py.)
- The Triton path (attention.mla_decode with kv_norm: the norm in the split kernel, q_rope read
  through its strides; with uv: the combine + value up-projection kernel, both weight layouts, with
  and without the gate) against the op's reference in Triton's CPU interpreter (fp32, fp16), and
  on CUDA in bf16, eagerly and graphed (GPU suite).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import k3compile
import k3compile.ops  # noqa: F401  (registers k3::)
from k3compile.model.functional import rms_norm
from k3compile.ops import reference as ref

H, L, R, NOPE, S = 4, 32, 16, 24, 40


def _inputs(M=2, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q = rn(M, H * (NOPE + R)).to(dtype)            # the q_b GEMM's output
    q_lat = rn(M, H, L).to(dtype)
    kv_a = rn(M, L + R + 8).to(dtype)[:, 4:4 + L + R]   # a strided column range, as split(qkv_a) gives
    w = (rn(L) * 0.2 + 1).to(dtype)
    cache = rn(M, S, L + R).to(dtype)
    lens = torch.tensor([3, 17, 30, 9][:M])
    return [x.to(device) for x in (q, q_lat, kv_a, w, cache, lens)]


def _step(variant):
    """The model's decode prologue (layers.MLA.forward), or one changed part of it."""
    def fn(q, q_lat, kv_a, w, cache, lens):
        q_rope = q.view(-1, H, NOPE + R)[..., NOPE:]
        if variant != "q_rope as it is":
            q_rope = q_rope.contiguous()
        lat = rms_norm(kv_a[:, :L], None if variant == "norm without weight" else w, 1e-6)
        if variant.startswith("norm written"):   # transformers-style / x / sqrt: other rounding orders
            xf = kv_a[:, :L].float()
            ms = xf.pow(2).mean(-1, keepdim=True) + 1e-6
            lat = (w * (xf * torch.rsqrt(ms)).to(kv_a.dtype) if variant.endswith("cast first")
                   else (xf / torch.sqrt(ms) * w.float()).to(kv_a.dtype))
        rope = kv_a[:, L:] if variant != "rope key of another tensor" else q[:, :R]
        if variant == "latent not normalised":
            lat = kv_a[:, :L] * 2
        kv_new = torch.cat([lat, rope], -1)
        return torch.ops.k3model.mla_decode(q_lat, q_rope, kv_new, cache, lens, 0.125)
    return fn


@pytest.mark.parametrize("variant, why", [
    ("model", None),
    ("q_rope as it is", None),
    ("norm written cast first", None),
    ("norm written with div", None),
    ("norm without weight", "has no [32] weight"),
    ("latent not normalised", "not an RMSNorm"),
    ("rope key of another tensor", "not [norm(kv_a[:, :32]), kv_a[:, 32:]]"),
])
def test_fold_mla_prologue_matches_the_prologue_or_says_why(variant, why):
    args = _inputs()
    c_eager, c_comp = args[4].clone(), args[4].clone()
    want = _step(variant)(*args[:4], c_eager, args[5])
    torch._dynamo.reset()
    k3compile.clear_reports()
    fn = torch.compile(_step(variant), backend=k3compile.backend(mode="eager", passes=["fold_mla_prologue"]),
                       fullgraph=True, dynamic=False)
    got = fn(*args[:4], c_comp, args[5])
    p = next(p for p in k3compile.last_report().passes if p.name == "fold_mla_prologue")
    assert p.expected == 1 and p.error is None and p.skipped is None
    if why is None:
        assert p.matched == 1 and not p.near_misses
        assert any("q_rope copy" in n for n in p.notes) == (variant != "q_rope as it is"), p.notes
        torch.testing.assert_close(got, want, rtol=0, atol=0)     # the reference is the same math
        torch.testing.assert_close(c_comp, c_eager, rtol=0, atol=0)
    else:
        assert p.matched == 0 and len(p.near_misses) == 1 and why in p.near_misses[0].reason, p.near_misses
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(c_comp, c_eager, rtol=0, atol=0)


def test_reference_is_the_unfolded_math():
    """k3::mla_decode_normed's reference = the model's norm and cat, then k3model::mla_decode: exact."""
    q, q_lat, kv_a, w, cache, lens = _inputs(M=3, dtype=torch.float32, seed=3)
    c1, c2 = cache.clone(), cache.clone()
    want = _step("model")(q, q_lat, kv_a, w, c1, lens)
    q_rope = q.view(-1, H, NOPE + R)[..., NOPE:]
    got = torch.ops.k3.mla_decode_normed(q_lat, q_rope, kv_a, w, 1e-6, c2, lens, 0.125)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(c1, c2, rtol=0, atol=0)


_TRITON_CPU = """
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.environ["K3_TESTS"])
from test_mla_prologue import _inputs, H, L, R, NOPE
from k3compile.kernels import attention, tuning
from k3compile.ops import reference as ref
tuning.MLA_MIN_CH = 32     # several splits of these small caches
worst = {}
for dtype in (torch.float32, torch.float16):
    q, q_lat, kv_a, w, cache, lens = _inputs(M=3, dtype=dtype, seed=5)
    for m, n in enumerate(lens.tolist()):
        cache[m, n + 1:] = float("nan")     # garbage past each row's end must not leak
    q_rope = q.view(-1, H, NOPE + R)[..., NOPE:]
    c1, c2 = cache.clone(), cache.clone()
    o_ref = ref.mla_decode_normed(q_lat, q_rope, kv_a, w, 1e-6, c1, lens, 0.125)
    assert attention.mla_decode_fits(q_lat, q_rope, kv_a, c2)
    o = attention.mla_decode(q_lat, q_rope, kv_a, c2, lens, 0.125, kv_norm=(w, 1e-6))
    assert o.dtype == o_ref.dtype and not o.isnan().any()
    ar = torch.arange(3)
    rows = c2[ar, lens].float(), c1[ar, lens].float()
    keep = torch.ones(c1.shape[:2], dtype=torch.bool)
    keep[ar, lens] = False
    worst[str(dtype)] = (((o.float() - o_ref.float()).abs().max() / o_ref.float().abs().max()).item(),
                         ((rows[0] - rows[1]).abs().max() / rows[1].abs().max()).item(),
                         torch.equal(c1[keep].nan_to_num(7.0), c2[keep].nan_to_num(7.0)))
q, q_lat, kv_a, w, cache, lens = _inputs(M=3, dtype=torch.float16, seed=6)
q_rope = q.view(-1, H, NOPE + R)[..., NOPE:]
c1, c2, c3 = cache.clone(), cache.clone(), cache.clone()
ref.mla_decode_normed(q_lat, q_rope, kv_a, w, 1e-6, c1, lens, 0.125, ref.NORM_CAST_FIRST)
ref.mla_decode_normed(q_lat, q_rope, kv_a, w, 1e-6, c3, lens, 0.125)
attention.mla_decode(q_lat, q_rope, kv_a, c2, lens, 0.125, kv_norm=(w, 1e-6, ref.NORM_CAST_FIRST))
ar = torch.arange(3)
worst["cast_first_row_diffs"] = (int((c2[ar, lens] != c1[ar, lens]).sum()), int((c2[ar, lens] != c3[ar, lens]).sum()))
print(worst)
"""


def test_triton_path_matches_reference_in_the_interpreter():
    """The split kernel normalising the new token's latent itself (and reading a strided q_rope)
    equals the op's reference: the output (fp32 to 1e-5, fp16 to 2e-3 relative), the cache row it
    writes (fp32 1e-6, fp16 one rounding step), the rest of the cache untouched. With the norm's
    cast-first rounding order (NORM_CAST_FIRST) the row is closer to that order's reference than to
    the default order's."""
    env = dict(os.environ, K3_TESTS=os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _TRITON_CPU], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    worst = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own subprocess's dict
    mine, other = worst.pop("cast_first_row_diffs")   # the new cache row in the cast-first order
    assert mine < other, (mine, other)
    assert len(worst) == 2, worst
    for dt, (out_err, row_err, same_else) in worst.items():
        assert out_err < (1e-5 if "float32" in dt else 2e-3), (dt, out_err)
        assert row_err < (1e-6 if "float32" in dt else 1e-3), (dt, row_err)
        assert same_else, dt


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 4, 16])
def test_mla_decode_normed_on_cuda_bf16_eager_and_graphed(M):
    """At K3's widths (12 heads, L 512, rope 64, nope 128) on a 1032-slot cache: the op's CUDA kernel
    (registry: triton_mla) against its reference, eagerly and replayed from a CUDA graph with new
    inputs (2e-2 relative: bf16, softmax weights rounded to bf16); the cache row it writes within one
    bf16 rounding step of the reference's."""
    from k3compile.kernels import dispatch
    Hh, Ll, Rr, Nn, Ss = 12, 512, 64, 128, 1032
    g = torch.Generator("cuda").manual_seed(M)

    def draw():
        q = torch.randn(M, Hh * (Nn + Rr), device="cuda", generator=g).bfloat16()
        ql = torch.randn(M, Hh, Ll, device="cuda", generator=g).bfloat16()
        kva = (torch.randn(M, 1536 + Ll + Rr, device="cuda", generator=g) * 3).bfloat16()[:, 1536:]
        return q, ql, kva

    w = (torch.rand(Ll, device="cuda", generator=g) + 0.5).bfloat16()
    cache = torch.randn(M, Ss, Ll + Rr, device="cuda", generator=g).bfloat16()
    lens = torch.randint(0, Ss - 2, (M,), device="cuda", generator=g)
    q, ql, kva = draw()
    qr = q.view(M, Hh, Nn + Rr)[..., Nn:]
    assert dispatch.pick("mla_decode_normed", "cuda", ql, qr, kva, w, 1e-6, cache, lens, 0.1).name == "triton_mla"

    def check(out, c_got, c_in):
        c_ref = c_in.clone()
        want = ref.mla_decode_normed(ql, qr, kva, w, 1e-6, c_ref, lens, 0.1)
        assert ((out.float() - want.float()).abs().max() / want.float().abs().max()).item() < 2e-2
        ar = torch.arange(M, device="cuda")
        d = (c_got[ar, lens].float() - c_ref[ar, lens].float()).abs()
        assert (d <= c_ref[ar, lens].float().abs() * 2 ** -7 + 1e-6).all()
        keep = torch.ones(M, Ss, dtype=torch.bool, device="cuda")
        keep[ar, lens] = False
        assert torch.equal(c_got[keep], c_ref[keep])

    c = cache.clone()
    check(torch.ops.k3.mla_decode_normed(ql, qr, kva, w, 1e-6, c, lens, 0.1), c, cache)
    out = torch.empty(M, Hh, Ll, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(torch.ops.k3.mla_decode_normed(ql, qr, kva, w, 1e-6, c, lens, 0.1))
    for t, v in zip((q, ql, kva), draw()):
        t.copy_(v)
    lens.add_(1)
    c_in = c.clone()
    graph.replay()
    check(out, c, c_in)


def _out_step(variant):
    """The model's attention output path (layers.MLA.forward): o = mla_decode(...), then
    einsum("nhl,hvl->nhv", o, W_uv) * sigmoid(gate); or one changed part of it."""
    def fn(q, q_lat, kv_a, w, cache, lens, w_uv, gate):
        q_rope = q.view(-1, H, NOPE + R)[..., NOPE:].contiguous()
        kv_new = torch.cat([rms_norm(kv_a[:, :L], w, 1e-6), kv_a[:, L:]], -1)
        o_lat = torch.ops.k3model.mla_decode(q_lat, q_rope, kv_new, cache, lens, 0.125)
        o = torch.einsum("nhl,hvl->nhv", o_lat, w_uv) * torch.sigmoid(gate.view(-1, H, 8))
        return (o, o_lat * 2) if variant == "output read twice" else o
    return fn


@pytest.mark.parametrize("variant, why", [
    ("model", None),
    ("output read twice", "not read by one per-head bmm"),
])
def test_fold_mla_output_matches_the_output_path_or_says_why(variant, why):
    args = _inputs()
    g = torch.Generator().manual_seed(9)
    extra = [(torch.randn(H, 8, L, generator=g) / 4).bfloat16(), torch.randn(2, H * 8, generator=g).bfloat16()]
    c_eager, c_comp = args[4].clone(), args[4].clone()
    want = _out_step(variant)(*args[:4], c_eager, args[5], *extra)
    torch._dynamo.reset()
    k3compile.clear_reports()
    passes = ["fold_mla_prologue", "lower_decode_gemm", "fold_mla_output"]
    fn = torch.compile(_out_step(variant), backend=k3compile.backend(mode="eager", passes=passes),
                       fullgraph=True, dynamic=False)
    got = fn(*args[:4], c_comp, args[5], *extra)
    rep = k3compile.last_report()
    p = rep.get("fold_mla_output")
    assert p.expected == 1 and p.error is None and p.skipped is None
    assert rep.get("fold_mla_prologue").matched == 1
    if why is None:
        assert p.matched == 1 and not p.near_misses
    else:
        assert p.matched == 0 and len(p.near_misses) == 1 and why in p.near_misses[0].reason, p.near_misses
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(c_comp, c_eager, rtol=0, atol=0)


_UV_CPU = """
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.environ["K3_TESTS"])
import test_mla_prologue as T
from test_mla_prologue import _inputs, H, L, R, NOPE
from k3compile.kernels import attention, tuning
T.S = int(os.environ["K3_TEST_S"])                 # cache slots (_inputs reads it)
from k3compile.ops import reference as ref
tuning.MLA_MIN_CH = int(os.environ["K3_TEST_MIN_CH"])
tuning.MLA_BS = int(os.environ["K3_TEST_BS"])
g = torch.Generator().manual_seed(3)
rows = []
for dt in (torch.float32, torch.float16):
    for w_nk in (True, False):
        for gated in (True, False):
            q, q_lat, kv_a, w, cache, lens = _inputs(M=3, dtype=dt, seed=5)
            lens = torch.tensor([int(v) for v in os.environ["K3_TEST_LENS"].split(",")])
            V = 24   # not a multiple of the kernel's 16 value columns
            wuv = (torch.randn(*((H, V, L) if w_nk else (H, L, V)), generator=g) / 6).to(dt)
            gate = torch.randn(3, H, V, generator=g).to(dt) if gated else None
            q_rope = q.view(-1, H, NOPE + R)[..., NOPE:]
            c1, c2 = cache.clone(), cache.clone()
            want = ref.mla_decode_uv(q_lat, q_rope, kv_a, w, 1e-6, c1, lens, 0.125, wuv, w_nk, gate)
            got = attention.mla_decode(q_lat, q_rope, kv_a, c2, lens, 0.125, kv_norm=(w, 1e-6), uv=(wuv, w_nk, gate))
            rows.append((str(dt), w_nk, gated, tuple(got.shape) == tuple(want.shape) and got.stride() == want.stride(),
                         ((got.float() - want.float()).abs().max() / want.float().abs().max()).item(),
                         torch.equal(c1, c2)))
print(rows)
"""


_UV_FORMS = {   # launch flags, split rows / tile rows, cache slots, the 3 rows' lengths
    "default": dict(K3_KNOBS="mla_uv_flat=0", K3_TEST_MIN_CH="32", K3_TEST_BS="32", K3_TEST_S="40",
                    K3_TEST_LENS="3,17,30"),
    # 13 splits of one tile: the constant split count's unrolled loop over 2 groups of 8, the last one part
    # masked; the first row's splits mostly empty
    "flat": dict(K3_KNOBS="mla_uv_flat=1", K3_TEST_MIN_CH="16", K3_TEST_BS="16", K3_TEST_S="200",
                 K3_TEST_LENS="3,150,199"),
}


@pytest.mark.parametrize("form", list(_UV_FORMS))
def test_combine_uv_kernel_matches_reference_in_the_interpreter(form):
    """attention.mla_decode(uv=): the split kernel, then the combine + value up-projection kernel, equals
    k3::mla_decode_uv's reference (fp32 to 1e-5, fp16 to 2e-3 relative) in its layout (decode_bmm's:
    [H, M, V] stored token-major), for W_uv stored [H, V, L] and [H, L, V], with and without the gate;
    the cache written as the reference writes it. The forms (_UV_FORMS): the default kernels; the
    combine's constant split count (tuning.MLA_UV_FLAT)."""
    env = dict(os.environ, K3_TESTS=os.path.dirname(os.path.abspath(__file__)), **_UV_FORMS[form])
    r = subprocess.run([sys.executable, "-c", _UV_CPU], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own subprocess's list
    assert len(rows) == 8, rows
    for dt, w_nk, gated, layout, err, same_cache in rows:
        assert layout and same_cache, (dt, w_nk, gated)
        assert err < (1e-5 if "float32" in dt else 2e-3), (dt, w_nk, gated, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 4, 16])
def test_mla_decode_uv_on_cuda_bf16_eager_and_graphed(M):
    """k3::mla_decode_uv at K3's widths (12 heads, L 512, V 128, W_uv [H, V, L], the gate) on a
    1032-slot cache: the CUDA kernels (registry: triton_mla_uv) against the reference, eagerly and
    replayed from a CUDA graph with new inputs (2e-2 relative), the cache row within one bf16
    rounding step."""
    from k3compile.kernels import dispatch
    Hh, Ll, Rr, Nn, Vv, Ss = 12, 512, 64, 128, 128, 1032
    g = torch.Generator("cuda").manual_seed(M + 50)

    def draw():
        q = torch.randn(M, Hh * (Nn + Rr), device="cuda", generator=g).bfloat16()
        ql = torch.randn(M, Hh, Ll, device="cuda", generator=g).bfloat16()
        kva = (torch.randn(M, 1536 + Ll + Rr, device="cuda", generator=g) * 3).bfloat16()[:, 1536:]
        gate = torch.randn(M, Hh, Vv, device="cuda", generator=g).bfloat16()
        return q, ql, kva, gate

    w = (torch.rand(Ll, device="cuda", generator=g) + 0.5).bfloat16()
    wuv = (torch.randn(Hh, Vv, Ll, device="cuda", generator=g) / Ll ** 0.5).bfloat16()
    cache = torch.randn(M, Ss, Ll + Rr, device="cuda", generator=g).bfloat16()
    lens = torch.randint(0, Ss - 2, (M,), device="cuda", generator=g)
    q, ql, kva, gate = draw()
    qr = q.view(M, Hh, Nn + Rr)[..., Nn:]
    args = lambda c: (ql, qr, kva, w, 1e-6, c, lens, 0.1, wuv, True, gate)  # noqa: E731
    assert dispatch.pick("mla_decode_uv", "cuda", *args(cache)).name == "triton_mla_uv"

    def check(out, c_got, c_in, layout=True):
        c_ref = c_in.clone()
        want = ref.mla_decode_uv(*args(c_ref))
        assert out.shape == want.shape and (out.stride() == want.stride() or not layout)
        assert ((out.float() - want.float()).abs().max() / want.float().abs().max()).item() < 2e-2
        ar = torch.arange(M, device="cuda")
        d = (c_got[ar, lens].float() - c_ref[ar, lens].float()).abs()
        assert (d <= c_ref[ar, lens].float().abs() * 2 ** -7 + 1e-6).all()

    c = cache.clone()
    check(torch.ops.k3.mla_decode_uv(*args(c)), c, cache)
    out = torch.empty(Hh, M, Vv, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(torch.ops.k3.mla_decode_uv(*args(c)))
    for t, v in zip((q, ql, kva, gate), draw()):
        t.copy_(v)
    lens.add_(1)
    c_in = c.clone()
    graph.replay()
    check(out, c, c_in, layout=False)   # copied into a contiguous buffer
