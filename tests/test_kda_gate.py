"""fold_kda_gate: the KDA decode prologue (q/k L2 norms, the gate, beta's sigmoid) folded into
k3::kda_decode_gated.

- CPU: on the model's prologue math the pass fires and the compiled step equals eager exactly
  (state too); each way the prologue can differ from K3's stops the match with a reason that
  names it, and the step stays correct. (The whole-model site counts and the compile-vs-eager
  equality at TP 1 / 2 are in test_compiler.py, where every pass must match every site.)
- The fla-core kernel path (attention.kda_decode_gated_fla: norms, gate and sigmoid in the kernel,
  state in place) against the op's reference, in Triton's CPU interpreter where fla-core is
  installed (skipped in CI), and on CUDA (GPU suite).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import k3compile
import k3compile.ops  # noqa: F401  (registers k3::)
from k3compile.ops import reference as ref

H, K = 3, 16


def _inputs(M=2, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    xq, xk, v, f = (rn(M, H, K).to(dtype) for _ in range(4))
    b = rn(M, H).to(dtype)
    a_log, dt_bias = 0.5 * rn(H), 0.5 * rn(H * K)
    state = 0.5 * rn(M, H, K, K)
    return [x.to(device) for x in (xq, xk, v, f, b, a_log, dt_bias, state)]


def _step(variant):
    """The model's decode prologue (layers.KDA.forward), or one changed part of it."""
    def fn(xq, xk, v, f, b, a_log, dt_bias, state):
        q = F.normalize(xq.float(), dim=-1) * K ** -0.5
        k = F.normalize(xk.float(), dim=-1) * (0.5 if variant == "k scaled" else 1.0)
        if variant == "q not normalised":
            q = xq.float() * K ** -0.5
        pre = f.float() + dt_bias.view(1, H, K)
        if variant == "softplus gate":
            g = -torch.exp(a_log).view(1, H, 1) * F.softplus(pre)
        else:
            g = -5.0 * torch.sigmoid(torch.exp(a_log).view(1, H, 1) * pre)
        beta = torch.sigmoid(b.float()) if variant != "beta not sigmoided" else b.float().clamp(0, 1)
        return torch.ops.k3model.kda_decode(q.to(v.dtype), k.to(v.dtype), v, g, beta, state)
    return fn


@pytest.mark.parametrize("variant, why", [
    ("model", None),
    ("softplus gate", "the decay is not lower * sigmoid"),
    ("k scaled", "k is scaled after its L2 norm"),
    ("q not normalised", "q is not L2-normalised"),
    ("beta not sigmoided", "beta is not sigmoid"),
])
def test_fold_kda_gate_matches_the_prologue_or_says_why(variant, why):
    args = _inputs()
    st_eager, st_comp = args[-1].clone(), args[-1].clone()
    want = _step(variant)(*args[:-1], st_eager)
    torch._dynamo.reset()
    k3compile.clear_reports()
    fn = torch.compile(_step(variant), backend=k3compile.backend(mode="eager", passes=["fold_kda_gate"]),
                       fullgraph=True, dynamic=False)
    got = fn(*args[:-1], st_comp)
    p = next(p for p in k3compile.last_report().passes if p.name == "fold_kda_gate")
    assert p.expected == 1 and p.error is None and p.skipped is None
    if why is None:
        assert p.matched == 1 and not p.near_misses
        torch.testing.assert_close(got, want, rtol=0, atol=0)     # the reference is the same math
        torch.testing.assert_close(st_comp, st_eager, rtol=0, atol=0)
    else:
        assert p.matched == 0 and len(p.near_misses) == 1 and why in p.near_misses[0].reason, p.near_misses
        torch.testing.assert_close(got, want)          # unrewritten (AOT's decompositions round a little
        torch.testing.assert_close(st_comp, st_eager)  # differently, e.g. softplus: 3e-8)


def test_reference_is_the_unfolded_math():
    """k3::kda_decode_gated's reference = the model's prologue then k3model::kda_decode, to fp32
    rounding: the reference takes the norm as sqrt(sum(x^2)) (the form of the post-grad graph the
    pass matches), F.normalize through torch's norm kernel, whose summation order differs on some
    CPUs (1.5e-8 apart on one)."""
    xq, xk, v, f, b, a_log, dt_bias, state = _inputs(M=3, dtype=torch.float32, seed=3)
    st1, st2 = state.clone(), state.clone()
    want = _step("model")(xq, xk, v, f, b, a_log, dt_bias, st1)
    got = torch.ops.k3.kda_decode_gated(xq, xk, v, f, b, a_log, dt_bias, st2, -5.0, K ** -0.5, 1e-12, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(st1, st2, rtol=1e-6, atol=1e-7)


_FLA_CPU = """
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.environ["K3_TESTS"])
from test_kda_gate import _inputs, K
from k3compile.kernels import attention, dispatch
from k3compile.ops import reference as ref
worst = 0.0
for dtype in (torch.float32, torch.float16):
    xq, xk, v, f, b, a_log, dt_bias, state = _inputs(M=3, dtype=dtype, seed=5)
    st_ref, st_fla = state.clone(), state.clone()
    o_ref = ref.kda_decode_gated(xq, xk, v, f, b, a_log, dt_bias, st_ref, -5.0, K ** -0.5, 1e-12, torch.float32)
    ptr = st_fla.data_ptr()
    o = attention.kda_decode_gated_fla(xq, xk, v, f, b, a_log, dt_bias, st_fla, -5.0, K ** -0.5)
    assert o.dtype == v.dtype and o.shape == o_ref.shape and st_fla.data_ptr() == ptr
    for a, c in ((o, o_ref), (st_fla, st_ref)):
        worst = max(worst, ((a.float() - c.float()).abs().max() / c.float().abs().max()).item())
print(worst)
"""


def test_fla_kernel_path_matches_reference_in_the_triton_interpreter():
    """fla's fused_recurrent_kda with the norms, the gate and beta's sigmoid in the kernel (and the
    state updated in place) equals the op's reference; skipped without fla-core (CI)."""
    env = dict(os.environ, K3_TESTS=os.path.dirname(os.path.abspath(__file__)))
    env.pop("K3_KNOBS", None)
    if subprocess.run([sys.executable, "-c", "import fla.ops.kda, einops"], env=env, capture_output=True).returncode:
        pytest.skip("fla-core (and einops) not installed")
    r = subprocess.run([sys.executable, "-c", _FLA_CPU], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert float(r.stdout.split()[-1]) < 5e-3, r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kda_decode_gated_on_cuda_eager_and_graphed():
    """On CUDA the op runs fla's kernel (where fla-core imports) and equals its reference, also
    replayed from a CUDA graph with new inputs."""
    from k3compile.kernels import dispatch
    args = _inputs(M=4, dtype=torch.bfloat16, device="cuda", seed=7)
    k = dispatch.pick("kda_decode_gated", "cuda", *args, -5.0, K ** -0.5, 1e-12, torch.bfloat16)
    if k is None:
        if os.environ.get("K3_REQUIRE_FLA", "0") not in ("", "0"):
            pytest.fail("fla-core's fused_recurrent_kda_fwd is not usable here")
        pytest.skip("no fla-core: the op runs its reference")
    consts = (-5.0, K ** -0.5, 1e-12, torch.bfloat16)
    st_ref, st_op = args[-1].clone(), args[-1].clone()
    want = ref.kda_decode_gated(*args[:-1], st_ref, *consts)
    got = torch.ops.k3.kda_decode_gated(*args[:-1], st_op, *consts)
    err = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()  # noqa: E731
    assert err(got, want) < 3e-2 and err(st_op, st_ref) < 3e-2, (err(got, want), err(st_op, st_ref))
    from _cuda_graph import replay_once
    out, st_g = replay_once(lambda st: torch.ops.k3.kda_decode_gated(*args[:-1], st, *consts), args[-1])
    assert err(out, want) < 3e-2 and err(st_g, st_ref) < 3e-2
