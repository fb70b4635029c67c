"""fold_kda_conv: the KDA short conv + SiLU of one decode token folded into k3::kda_conv_decode.

CPU: on the model's conv math (layers.KDA.forward) the pass fires and the compiled step equals
eager exactly, the conv state included, over two steps; each way the conv can differ stops the
match with a reason naming it, and the step stays correct. (The whole-model site counts at TP 1 / 2
are in test_compiler.py; the Triton kernel against the op's reference in test_kernels.py.)
"""
from __future__ import annotations

import pytest

from k3compile.config import knobs_text
import torch
import torch.nn.functional as F

import k3compile
import k3compile.ops  # noqa: F401  (registers k3::)

H, K, KW = 2, 16, 4


def _step(variant):
    """Projection slices -> the model's conv -> kda_decode (layers.KDA.forward at T=1), or one
    changed part of it."""
    def fn(x, conv_state, conv_w, g, b, state):
        M = x.shape[0]
        q, k, v = x.split(H * K, -1)
        qkv = torch.cat([q, k, v], -1).view(M, 1, -1).transpose(1, 2)
        window = torch.cat([conv_state, qkv], dim=-1)
        conv_state.copy_(window[..., -(KW - 1):])
        cols = window.unfold(-1, KW, 1)
        act = F.gelu if variant == "gelu" else F.silu
        y = act((cols * conv_w.unsqueeze(1)).sum(-1)).transpose(1, 2).reshape(M, -1)
        q, k, v = y.split(H * K, dim=-1)
        extra = window.float().mean() if variant == "window reused" else 0.0
        q = F.normalize(q.view(-1, H, K).float(), dim=-1) * K ** -0.5
        k = F.normalize(k.view(-1, H, K).float(), dim=-1)
        o = torch.ops.k3model.kda_decode(q.to(v.dtype), k.to(v.dtype), v.view(-1, H, K), g, b, state)
        return o + extra
    return fn


def _inputs(M=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = rn(M, 3 * H * K).bfloat16()
    conv_state = rn(M, 3 * H * K, KW - 1).bfloat16()
    conv_w = (rn(3 * H * K, KW) / 2).bfloat16()
    g = -torch.rand(M, H, K, generator=gen)
    b = torch.rand(M, H, generator=gen)
    state = 0.5 * rn(M, H, K, K)
    return x, conv_state, conv_w, g, b, state


@pytest.mark.parametrize("variant, why", [
    ("model", None),
    ("gelu", "is not SiLU"),
    ("window reused", "the window is used other than by the conv and the state update"),
])
def test_fold_kda_conv_matches_the_conv_or_says_why(variant, why):
    x, cs, w, g, b, st = _inputs()
    cs_e, st_e, cs_c, st_c = cs.clone(), st.clone(), cs.clone(), st.clone()
    torch._dynamo.reset()
    k3compile.clear_reports()
    fn = torch.compile(_step(variant), backend=k3compile.backend(mode="eager", passes=["fold_kda_conv"]),
                       fullgraph=True, dynamic=False)
    for _ in range(2):   # the second step reads the state the first wrote back
        want = _step(variant)(x, cs_e, w, g, b, st_e)
        got = fn(x, cs_c, w, g, b, st_c)
        x = x.roll(1, 0)
    p = next(p for p in k3compile.last_report().passes if p.name == "fold_kda_conv")
    assert p.expected == 1 and p.error is None and p.skipped is None
    if why is None:
        assert p.matched == 1 and not p.near_misses
        tol = dict(rtol=0, atol=0)       # the op's reference is the model's math
    else:
        assert p.matched == 0 and len(p.near_misses) == 1 and why in p.near_misses[0].reason, p.near_misses
        tol = {}                         # unrewritten: AOT's decompositions may round a little differently
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(cs_c, cs_e, **tol)
    torch.testing.assert_close(st_c, st_e, **tol)


@pytest.mark.parametrize("v2", [True, False])
def test_fold_kda_conv_state_is_updated_in_place_under_inductor(v2, monkeypatch):
    """With Inductor (CPU codegen) the emitted auto_functionalized k3::kda_conv_decode_ is turned back
    into the in-place call on the conv-state input: the generated code calls the op on that input
    itself, with no clone of it and no copy of a new state into it; two steps equal eager exactly
    (output, conv state, recurrent state). v2=False: Inductor's enable_auto_functionalized_v2 off (as
    vLLM sets it): the graph's mutating ops come in the first form, and the pass emits that form."""
    import re

    from torch._inductor.utils import run_and_get_code
    monkeypatch.setenv("K3_KNOBS", knobs_text(conv_inplace="1"))
    x, cs, w, g, b, st = _inputs()
    cs_e, st_e = cs.clone(), st.clone()
    torch._dynamo.reset()
    k3compile.clear_reports()
    fn = torch.compile(_step("model"), backend=k3compile.backend(passes=["fold_kda_conv"], gate="off"),
                       fullgraph=True, dynamic=False)
    for i in range(2):
        if i == 0:
            # caches off: the pass must run here (a graph cached by an earlier run would skip it)
            with torch._inductor.config.patch(enable_auto_functionalized_v2=v2, force_disable_caches=True):
                got, codes = run_and_get_code(fn, x, cs, w, g, b, st)
            assert k3compile.last_report().get("fold_kda_conv").matched == 1
        else:
            got = fn(x, cs, w, g, b, st)
        want = _step("model")(x, cs_e, w, g, b, st_e)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(cs, cs_e, rtol=0, atol=0)
        torch.testing.assert_close(st, st_e, rtol=0, atol=0)
        x = x.roll(1, 0)
    code = "\n".join(codes)
    call = re.search(r"torch\.ops\.k3\.kda_conv_decode_\.default\((.*)\)", code)
    assert call, code
    state_arg = call.group(1).split("), ")[-1].split(", ")[0]       # after the three reinterpret_tensor(...)
    assert re.fullmatch(r"arg\d+_1", state_arg), call.group(0)
    assert f"{state_arg}.copy_" not in code and f"clone({state_arg}" not in code and "k3.kda_conv_decode.default" not in code


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_fold_kda_conv_in_place_on_cuda_under_inductor(mode, monkeypatch):
    """On CUDA at M=1 (where the gate applies the pass) with Inductor, and replayed as CUDA graphs
    (reduce-overhead): three steps against eager, each reading the conv state the last one wrote.
    The conv state (copied values) equal exactly; the output within 2e-2 of its max (the Triton
    conv rounds its fp32 sum once; the recurrence op is the same in both)."""
    monkeypatch.setenv("K3_KNOBS", knobs_text(conv_inplace="1"))
    x, cs, w, g, b, st = (t.cuda() for t in _inputs(M=1))
    cs_e, st_e = cs.clone(), st.clone()
    torch._dynamo.reset()
    k3compile.clear_reports()
    fn = torch.compile(_step("model"), backend=k3compile.backend(passes=["fold_kda_conv"]), mode=mode,
                       fullgraph=True, dynamic=False)
    for i in range(3):
        with torch._inductor.config.patch(force_disable_caches=i == 0):   # the pass runs (no cached graph)
            got = fn(x, cs, w, g, b, st).clone()
        want = _step("model")(x, cs_e, w, g, b, st_e)
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() < 2e-2
        assert torch.equal(cs, cs_e)
        x = x * 0.9 + 0.1
    p = next(p for p in k3compile.last_report().passes if p.name == "fold_kda_conv")
    assert p.matched == p.expected == 1, k3compile.last_report().render()
