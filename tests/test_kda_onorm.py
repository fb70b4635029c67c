"""fold_kda_onorm: the KDA output norm (per-head RMSNorm(o) * sigmoid(g)) folded into k3::kda_step_decode_.

- CPU: on the model's decode step with its output norm the pass fires after the four KDA folds and
  the compiled step equals eager exactly over two steps (output, both states), in bf16 and in fp32
  (no casts there: the norm reads o itself); on the fp32 tiny model at every KDA layer; where it cannot
  apply, the near-miss says why; under Inductor (CPU codegen) the step stays in place on both states
  and no norm is left beside it.
- The Triton kernel with its NORM epilogue against the op's reference in Triton's CPU interpreter
  (fp32 / fp16; 1, 2 and 4 programs per head; the gate a strided slice as in the model), and on CUDA
  at real widths (GPU suite): repeated steps and a CUDA-graph replay.
"""
from __future__ import annotations

import os
import re

import pytest

from k3compile.config import knobs_text
import torch

import k3compile
import k3compile.ops  # noqa: F401  (registers k3::)
from k3compile.model.functional import rms_norm
from k3compile.ops import reference as ref
from test_kda_step import FOLDS, H, K, R, _err, _inputs, _kernel_args, _step, check_site

ALL = [*FOLDS, "fold_kda_onorm"]
EPS = 1e-5


def _step_norm(variant="model", h=H, k=K):
    """The model's KDA decode step and its output norm (layers.KDA.forward), or one changed part."""
    step = _step(h=h, k=k)

    def fn(x, conv_state, conv_w, fa, f_b, b, a_log, dt_bias, state, g, o_w):
        o = step(x, conv_state, conv_w, fa, f_b, b, a_log, dt_bias, state)
        act = torch.tanh if variant == "tanh gate" else torch.sigmoid
        y = rms_norm(o, o_w, EPS) * act(g.view(-1, h, k))
        if variant == "o read elsewhere":
            y = y + o.float().mean().to(y.dtype)
        return y
    return fn


def _norm_inputs(M=2, dtype=torch.bfloat16, device="cpu", seed=0, h=H, k=K):
    gen = torch.Generator().manual_seed(100 + seed)
    g = torch.randn(M, h * k + 3, generator=gen).to(dtype)[:, 3:]   # a column slice, as the in_proj split's
    o_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    return [g.to(device), o_w.to(device)]


@pytest.mark.parametrize("variant, passes, why, dtype", [
    ("model", ALL, None, torch.bfloat16),
    ("model", ["fold_kda_gate", "fold_kda_conv", "fold_kda_fb", "fold_kda_onorm"], "needs fold_kda_step's ops",
     torch.bfloat16),
    ("o read elsewhere", ALL, "readers", torch.bfloat16),
    ("tanh gate", ALL, "sigmoid", torch.bfloat16),
    # fp32: no cast between o and the norm, so the norm's x^2 and product read o itself
    ("model", ALL, None, torch.float32),
    ("o read elsewhere", ALL, "readers", torch.float32),
])
def test_fold_kda_onorm_matches_the_step_or_says_why(variant, passes, why, dtype):
    args = _inputs(dtype=dtype) + _norm_inputs(dtype=dtype)
    fn = torch.compile(_step_norm(variant), backend=k3compile.backend(mode="eager", passes=passes, dtypes=dtype),
                       fullgraph=True, dynamic=False)
    st_c = [args[1].clone(), args[8].clone()]
    st_e = [args[1].clone(), args[8].clone()]
    x = args[0]
    for _ in range(2):   # the second step reads the states the first wrote
        want = _step_norm(variant)(x, st_e[0], *args[2:8], st_e[1], *args[9:])
        got = fn(x, st_c[0], *args[2:8], st_c[1], *args[9:])
        x = x.roll(1, 0)
    if dtype == torch.float32 and why is None:
        # fp32 through the AOT decompositions is rounding apart from eager (about 1e-7), with or without the pass
        rep = k3compile.last_report()
        assert rep.get("fold_kda_onorm").matched == 1 and not rep.get("fold_kda_onorm").near_misses, rep.render()
        for c, e in zip([got, *st_c], [want, *st_e]):
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
    else:
        check_site("fold_kda_onorm", why, got, want, st_c, st_e)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_model_folds_every_kda_output_norm(dtype):
    """The tiny model (KDA layers 0, 1, 2 of 4) with the fused ops taking its dtype: every KDA layer's
    output norm folds, in fp32 as in bf16, and the logits stay eager's (fp32: within the rounding the
    AOT decompositions already give without any pass)."""
    from k3compile.model import K3Config, K3Model
    m = K3Model(K3Config.tiny(dtype=dtype, num_layers=4))
    ids = torch.tensor([[1], [2]])
    ref = m(ids, m.new_cache(2))
    f = torch.compile(m, backend=k3compile.backend(mode="eager", dtypes=dtype), fullgraph=True)
    got = f(ids, m.new_cache(2))
    p = k3compile.last_report().get("fold_kda_onorm")
    assert p.matched == p.expected == len(m.cfg.kda_layers) == 3 and not p.near_misses, p.near_misses
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_inductor_keeps_the_states_in_place_and_no_norm_kernel():
    """With Inductor (CPU codegen): one in-place k3::kda_step_decode_ call carrying the norm's weight and
    gate, no rsqrt left in the generated code (the norm went into the op), two steps equal to eager."""
    from torch._inductor.utils import run_and_get_code
    args = _inputs() + _norm_inputs()
    cs_e, st_e = args[1].clone(), args[8].clone()
    fn = torch.compile(_step_norm(), backend=k3compile.backend(passes=ALL, gate="off"), fullgraph=True,
                       dynamic=False)
    x = args[0]
    for i in range(2):
        if i == 0:
            with torch._inductor.config.patch(force_disable_caches=True):
                got, codes = run_and_get_code(fn, x, *args[1:])
            assert k3compile.last_report().get("fold_kda_onorm").matched == 1
        else:
            got = fn(x, *args[1:])
        want = _step_norm()(x, cs_e, *args[2:8], st_e, *args[9:])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(args[1], cs_e, rtol=0, atol=0)
        torch.testing.assert_close(args[8], st_e, rtol=0, atol=0)
        x = x.roll(1, 0)
    code = "\n".join(codes)
    call = re.search(r"torch\.ops\.k3\.kda_step_decode_\.default\((.*)\)", code)
    assert call and call.group(1).rstrip().endswith(f"torch.bfloat16, arg9_1, arg10_1, {EPS}"), code  # o_w, g, eps
    assert "arg1_1.copy_" not in code and "arg8_1.copy_" not in code, code   # both states in place
    assert "rsqrt" not in code, code


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's CPU interpreter (no-GPU machines)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, h, k, r, p", [(3, 2, 16, 16, "4"), (2, 3, 64, 32, "2"), (1, 2, 128, 128, "4"),
                                           (2, 2, 128, 32, "1")])
def test_kernel_norm_matches_reference_in_the_interpreter(monkeypatch, dtype, M, h, k, r, p):
    """attention.kda_step_decode with the output norm against the op's reference: the normed, gated o and
    both states; the counters left at zero."""
    pytest.importorskip("triton")
    from k3compile.kernels import attention, gemm
    monkeypatch.setenv("K3_KNOBS", knobs_text(kda_step_p=p))
    args = _kernel_args(M, dtype, "cpu", M + k, h, k, r)
    g, o_w = _norm_inputs(M, dtype, "cpu", M, h, k)
    consts = (-5.0, k ** -0.5, 1e-12, dtype)
    mine = [t.clone() for t in args[9:]]
    assert attention.kda_onorm_fits(args[0], args[2], args[7], o_w, g)
    want = ref.kda_step_decode_(*args, *consts, o_w, g, EPS)
    got = attention.kda_step_decode(*args[:9], *mine, *consts, o_w, g, EPS)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(mine[0], args[9], rtol=0, atol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-3   # fp16: the normed row and the sigmoid round once more
    assert _err(got, want) < tol and _err(mine[1], args[10]) < tol, (_err(got, want), _err(mine[1], args[10]))
    cnt = gemm.split_counters(torch.device("cpu"))
    assert cnt is None or not cnt.any()


def test_norm_fits_refuses_what_the_kernel_cannot_take():
    from k3compile.kernels import attention
    args = _kernel_args(2, torch.bfloat16, "cpu", 0, H, K, R)
    g, o_w = _norm_inputs(2, torch.bfloat16, "cpu", 0)
    assert attention.kda_onorm_fits(args[0], args[2], args[7], o_w, g)
    bad = {"weight of another width": (o_w[:-1], g), "weight fp32": (o_w.float(), g),
           "gate transposed": (o_w, g.t().contiguous().t()), "gate of another width": (o_w, g[:, 1:]),
           "no gate": (o_w, None)}
    for why, (w, gg) in bad.items():
        assert not attention.kda_onorm_fits(args[0], args[2], args[7], w, gg), why


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("p", ["4", "1"])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_kda_step_norm_on_cuda_at_real_widths_repeated_and_graphed(monkeypatch, M, p):
    """The step kernel with its output norm at a TP=8 rank's KDA widths (12 heads of 128), bf16, against
    the reference on CPU over three steps, then one step replayed from a CUDA graph."""
    from _cuda_graph import replay_once

    from k3compile.kernels import dispatch, gemm
    monkeypatch.setenv("K3_KNOBS", knobs_text(kda_step_p=p))
    args = _kernel_args(M, torch.bfloat16, "cuda", 5 + M, 12, 128, 128)
    g, o_w = _norm_inputs(M, torch.bfloat16, "cuda", M, 12, 128)
    consts = (-5.0, 128 ** -0.5, 1e-12, torch.bfloat16)
    norm = (o_w, g, EPS)
    k = dispatch.pick("kda_step_decode_", "cuda", *args, *consts, *norm)
    assert k is not None and k.name == "triton_kda_step"
    mine = [t.clone() for t in args[9:]]
    theirs = [t.cpu() for t in args[9:]]
    cpu_in = [t.cpu() for t in args[:9]]
    cpu_norm = (o_w.cpu(), g.cpu(), EPS)
    for step in range(3):
        want = ref.kda_step_decode_(*cpu_in, *theirs, *consts, *cpu_norm)
        got = torch.ops.k3.kda_step_decode_(*args[:9], *mine, *consts, *norm)
        torch.cuda.synchronize()
        assert torch.equal(mine[0].cpu(), theirs[0]), step
        # bf16: f and the normed q, k may round to the neighbouring value, then the norm's rounding
        assert _err(got.cpu(), want) < 2e-2 and _err(mine[1].cpu(), theirs[1]) < 1e-2, \
            (step, _err(got.cpu(), want), _err(mine[1].cpu(), theirs[1]))
        mine[1].copy_(theirs[1])
    cnt = gemm.split_counters(args[0].device)
    assert cnt is not None and not cnt.any()
    cs0, st0 = mine[0].cpu(), mine[1].cpu()
    want = ref.kda_step_decode_(*cpu_in, cs0, st0, *consts, *cpu_norm)
    out, (cs_g, st_g) = replay_once(lambda cs, st: torch.ops.k3.kda_step_decode_(*args[:9], cs, st, *consts, *norm),
                                    mine[0], mine[1])
    assert torch.equal(cs_g.cpu(), cs0)
    assert _err(out.cpu(), want) < 2e-2 and _err(st_g.cpu(), st0) < 1e-2, (_err(out.cpu(), want), _err(st_g.cpu(), st0))
