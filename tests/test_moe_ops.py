"""Tests for the k3model::mxfp4_experts custom op (k3compile.model.moe_ops)."""
from __future__ import annotations

import pytest
import torch

from k3compile.model.moe_ops import dequantize_experts, mxfp4_experts
from k3compile.model.mxfp4 import dequantize, quantize

OP = torch.ops.k3model.mxfp4_experts


def make_problem(N=37, k=4, E=8, L=64, I=64, x_dtype=torch.float32, id_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13, w13_s = quantize(torch.randn(E, 2 * I, L, generator=g) * 0.2)
    w2, w2_s = quantize(torch.randn(E, L, I, generator=g) * 0.2)
    x = torch.randn(N, L, generator=g).to(x_dtype)
    ids = torch.argsort(torch.rand(N, E, generator=g), dim=1)[:, :k].to(id_dtype)  # distinct per token
    return x, ids, w13, w13_s, w2, w2_s


def naive(x, ids, w13, w13_s, w2, w2_s, beta=4.0, linear_beta=25.0):
    """Per-token, per-slot loop straight from the spec (fp32 math, SiTU written out)."""
    W13 = dequantize(w13, w13_s, torch.float32)  # [E, 2I, L]
    W2 = dequantize(w2, w2_s, torch.float32)  # [E, L, I]
    I = W13.shape[1] // 2
    N, k = ids.shape
    out = torch.empty(N, k, x.shape[1], dtype=torch.float32)
    for n in range(N):
        xn = x[n].float()
        for j in range(k):
            e = int(ids[n, j])
            ug = W13[e] @ xn
            gate, up = ug[:I], ug[I:]
            mid = (beta * torch.tanh(gate / beta) * torch.sigmoid(gate)) * (linear_beta * torch.tanh(up / linear_beta))
            out[n, j] = W2[e] @ mid
    return out


def test_registered():
    assert hasattr(torch.ops.k3model, "mxfp4_experts")
    schema = str(OP.default._schema)
    assert "float beta" in schema and "float linear_beta" in schema


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_naive_loop(x_dtype, id_dtype):
    args = make_problem(x_dtype=x_dtype, id_dtype=id_dtype)
    out = mxfp4_experts(*args, 4.0, 25.0)
    ref = naive(*args)
    assert out.shape == (37, 4, 64) and out.dtype == x_dtype
    if x_dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # both are fp32 results rounded once to x_dtype: at most one ulp apart
        torch.testing.assert_close(out.float(), ref.to(x_dtype).float(), rtol=2**-7, atol=1e-3)
    # torch.ops path is the same op
    assert torch.equal(OP(*args, 4.0, 25.0), out)


def test_beta_and_linear_beta_are_used():
    args = make_problem(N=9, k=2, seed=1)
    out = mxfp4_experts(*args, 1.0, 0.5)
    torch.testing.assert_close(out, naive(*args, beta=1.0, linear_beta=0.5), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, mxfp4_experts(*args, 4.0, 25.0))


def test_skewed_routing_duplicates_and_unused_experts():
    x, ids, *w = make_problem(N=20, k=3, E=8, seed=2)
    ids = torch.zeros_like(ids)  # everything to expert 0, same expert in every slot
    ids[5:, 1] = 7
    ids[10, 2] = 3
    out = mxfp4_experts(x, ids, *w, 4.0, 25.0)
    torch.testing.assert_close(out, naive(x, ids, *w), rtol=1e-5, atol=1e-5)
    keep = torch.arange(20) != 10
    assert torch.equal(out[keep, 0], out[keep, 2])  # slots 0 and 2 both expert 0
    assert torch.equal(out[0, 0], out[0, 1])  # same expert, same token -> same row


def test_empty():
    x, ids, *w = make_problem(N=0, k=4)
    out = mxfp4_experts(x, ids, *w, 4.0, 25.0)
    assert out.shape == (0, 4, 64)
    x, ids, *w = make_problem(N=5, k=4)
    out = mxfp4_experts(x, ids[:, :0], *w, 4.0, 25.0)
    assert out.shape == (5, 0, 64)


def test_larger_batch_subset_vs_naive():
    # N a few thousand, E 16, L 128: must stay fast; check a sample of tokens against the loop
    args = make_problem(N=3000, k=8, E=16, L=128, I=64, x_dtype=torch.bfloat16, seed=3)
    out = mxfp4_experts(*args, 4.0, 25.0)
    assert out.shape == (3000, 8, 128)
    sel = torch.arange(0, 3000, 97)
    x, ids, *w = args
    ref = naive(x[sel], ids[sel], *w)
    torch.testing.assert_close(out[sel].float(), ref.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-3)


def test_dequantize_experts():
    _, _, w13, w13_s, _, _ = make_problem(E=3)
    d = dequantize_experts(w13, w13_s, torch.float32)
    assert d.shape == (3, 128, 64) and d.dtype == torch.float32
    assert torch.equal(d[1], dequantize(w13[1], w13_s[1], torch.float32))
    with pytest.raises(ValueError, match="3-D"):
        dequantize_experts(w13[0], w13_s[0])


# --------------------------------------------------------------------------- fake / meta / opcheck


def test_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, ids, *w = make_problem(N=6, k=2, x_dtype=torch.bfloat16)
    ids[0, 0] = 99  # out of range: a data-dependent check, must be skipped on fake tensors
    with FakeTensorMode() as mode:
        fx, fids, *fw = (mode.from_tensor(t) for t in (x, ids, *w))
        out = mxfp4_experts(fx, fids, *fw, 4.0, 25.0)
        assert out.shape == (6, 2, 64) and out.dtype == torch.bfloat16 and out.device == x.device
        # metadata checks still run on fake tensors
        with pytest.raises(ValueError, match="w13 shape"):
            mxfp4_experts(fx[:, :32], fids, *fw, 4.0, 25.0)


def test_meta_tensors():
    args = [t.to("meta") for t in make_problem(N=6, k=2)]
    args[1] = torch.full((6, 2), 1000, dtype=torch.int64, device="meta")
    out = mxfp4_experts(*args, 4.0, 25.0)
    assert out.shape == (6, 2, 64) and out.device.type == "meta" and out.dtype == torch.float32


@pytest.mark.parametrize("x_dtype, id_dtype", [(torch.float32, torch.int64), (torch.bfloat16, torch.int32)])
def test_opcheck(x_dtype, id_dtype):
    args = make_problem(N=5, k=2, E=3, L=32, I=32, x_dtype=x_dtype, id_dtype=id_dtype, seed=4)
    torch.library.opcheck(OP.default, (*args, 4.0, 25.0))


def test_compile_fullgraph():
    args = make_problem(N=7, k=2, E=4, L=32, I=32, seed=5)

    def f(x, ids, w13, w13_s, w2, w2_s):
        return mxfp4_experts(x, ids, w13, w13_s, w2, w2_s, 4.0, 25.0).sum(1)

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(*args)
    torch.testing.assert_close(out, f(*args))


# --------------------------------------------------------------------------- bad input


def _bad(**changes):
    x, ids, w13, w13_s, w2, w2_s = make_problem(N=6, k=2, E=4, L=64, I=64, seed=6)
    a = dict(x=x, topk_ids=ids, w13=w13, w13_scale=w13_s, w2=w2, w2_scale=w2_s, beta=4.0, linear_beta=25.0)
    for key, fn in changes.items():
        a[key] = fn(a[key])
    return a


BAD = [
    # (changes, exception, message)
    (dict(topk_ids=lambda t: t.fill_(4)), ValueError, r"topk_ids values must be in \[0, E=4\).*max 4"),
    (dict(topk_ids=lambda t: t.index_fill_(0, torch.tensor([2]), -1)), ValueError, r"topk_ids values .*min -1"),
    (dict(x=lambda t: t[0]), ValueError, r"x must be 2-D \[N, L\]"),
    (dict(x=lambda t: t[:, None]), ValueError, r"x must be 2-D"),
    (dict(topk_ids=lambda t: t[:, 0]), ValueError, r"topk_ids must be 2-D \[N, k\]"),
    (dict(topk_ids=lambda t: t[:4]), ValueError, r"topk_ids has 4 rows but x has N=6"),
    (dict(w13=lambda t: t[0]), ValueError, r"w13 must be 3-D"),
    (dict(w2_scale=lambda t: t[0]), ValueError, r"w2_scale must be 3-D"),
    (dict(x=lambda t: t[:, :32]), ValueError, r"w13 shape \(4, 128, 32\) does not match x latent dim L=32"),
    (dict(x=lambda t: torch.cat([t, t[:, :8]], 1)), ValueError, r"L=72 must be a multiple of 32"),
    (dict(w13=lambda t: t[:, :96], w13_scale=lambda t: t[:, :96]), ValueError, r"I=48 .* multiple of 32"),
    (dict(w13=lambda t: t[:, :127], w13_scale=lambda t: t[:, :127]), ValueError, r"w13.shape\[1\] must be 2\*I"),
    (dict(w13_scale=lambda t: t[:, :, :1]), ValueError, r"w13_scale shape \(4, 128, 1\) does not match; expected \(4, 128, 2\)"),
    (dict(w2=lambda t: t[:3]), ValueError, r"w2 shape \(3, 64, 32\) does not match; expected \(4, 64, 32\)"),
    (dict(w2=lambda t: t[:, :, :16]), ValueError, r"w2 shape .* expected \(4, 64, 32\)"),
    (dict(w2_scale=lambda t: t[:, :32]), ValueError, r"w2_scale shape"),
    (dict(x=lambda t: t.to(torch.float64)), TypeError, r"x must be bfloat16, float16 or float32"),
    (dict(x=lambda t: t.to(torch.int32)), TypeError, r"x must be"),
    (dict(topk_ids=lambda t: t.float()), TypeError, r"topk_ids must be int32 or int64"),
    (dict(topk_ids=lambda t: t.to(torch.int16)), TypeError, r"topk_ids must be int32 or int64"),
    (dict(w13=lambda t: t.to(torch.int8)), TypeError, r"w13 must be uint8"),
    (dict(w13_scale=lambda t: t.view(torch.float8_e8m0fnu)), TypeError, r"w13_scale must be uint8"),
    (dict(w2=lambda t: t.to(torch.int32)), TypeError, r"w2 must be uint8"),
    (dict(w2_scale=lambda t: t.float()), TypeError, r"w2_scale must be uint8"),
    (dict(beta=lambda v: 0.0), ValueError, r"beta must be a finite non-zero float"),
    (dict(linear_beta=lambda v: float("inf")), ValueError, r"linear_beta must be a finite non-zero float"),
]


@pytest.mark.parametrize("changes, exc, match", BAD)
def test_bad_input(changes, exc, match):
    a = _bad(**changes)
    with pytest.raises(exc, match=match):
        mxfp4_experts(**a)


def test_gathered_path_equals_reference():
    """The capture-safe path (used while a CUDA graph is captured) computes the same thing."""
    from k3compile.model.moe_ops import mxfp4_experts_gathered, mxfp4_experts_reference
    from k3compile.model.mxfp4 import quantize
    g = torch.Generator().manual_seed(3)
    E, I, L, N, k = 5, 64, 64, 7, 3
    w13, s13 = quantize(torch.randn(E, 2 * I, L, generator=g))
    w2, s2 = quantize(torch.randn(E, L, I, generator=g))
    x = torch.randn(N, L, generator=g)
    ids = torch.randint(0, E, (N, k), generator=g)
    a = mxfp4_experts_gathered(x, ids, w13, s13, w2, s2, 4.0, 25.0)
    b = mxfp4_experts_reference(x, ids, w13, s13, w2, s2, 4.0, 25.0)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
