"""fold_kda_step: fold_kda_conv's conv op and fold_kda_fb's recurrence op in one k3::kda_step_decode_.

- CPU: on the model's decode step (projection slices -> conv -> norms, gate with its f_b projection ->
  kda_decode) the pass fires after the three KDA folds and the compiled step equals eager exactly over
  two steps (output, conv state, recurrent state); where it cannot apply, the near-miss says why; under
  Inductor both states are updated in place (no copy of either). (The whole tiny model with every pass:
  test_cli's run test; the 93-layer count: test_compiler.)
- The Triton kernel against the op's reference in Triton's CPU interpreter (fp32 / fp16), with 1, 2
  and 4 programs per head; on CUDA at real widths (GPU suite): eager, graphed, over repeated steps
  (the programs' arrival counters must be left at zero), and the compiled step under Inductor.
"""
from __future__ import annotations

import os
import re

import pytest

from k3compile.config import knobs_text
import torch
import torch.nn.functional as F

import k3compile
import k3compile.ops  # noqa: F401  (registers k3::)
from k3compile.ops import reference as ref

H, K, R, KW = 2, 16, 8, 4
FOLDS = ["fold_kda_gate", "fold_kda_conv", "fold_kda_fb", "fold_kda_step"]


def _step(variant="model", h=H, k=K):
    """The model's KDA decode step from the input projection's slices (layers.KDA.forward at T=1), or
    one changed part of it."""
    def fn(x, conv_state, conv_w, fa, f_b, b, a_log, dt_bias, state):
        M = x.shape[0]
        q, kk, v = x.split(h * k, -1)
        extra = 0.0
        qkv = torch.cat([q, kk, v], -1).view(M, 1, -1).transpose(1, 2)
        window = torch.cat([conv_state, qkv], dim=-1)
        conv_state.copy_(window[..., -(KW - 1):])
        y = F.silu((window.unfold(-1, KW, 1) * conv_w.unsqueeze(1)).sum(-1)).transpose(1, 2).reshape(M, -1)
        q, kk, v = y.split(h * k, dim=-1)
        if variant == "conv q reused":
            extra = q.float().mean()
        qn = F.normalize(q.view(-1, h, k).float(), dim=-1) * k ** -0.5
        kn = F.normalize(kk.view(-1, h, k).float(), dim=-1)
        f = F.linear(fa, f_b).view(-1, h, k).float()
        g = -5.0 * torch.sigmoid(torch.exp(a_log).view(1, h, 1) * (f + dt_bias.view(1, h, k)))
        o = torch.ops.k3model.kda_decode(qn.to(v.dtype), kn.to(v.dtype), v.view(-1, h, k), g,
                                         torch.sigmoid(b.float()), state)
        return o + extra if variant == "conv q reused" else o
    return fn


def _inputs(M=2, dtype=torch.bfloat16, device="cpu", seed=0, h=H, k=K, r=R):
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = rn(M, 3 * h * k).to(dtype)
    conv_state = rn(M, 3 * h * k, KW - 1).to(dtype)
    conv_w = (rn(3 * h * k, KW) / 2).to(dtype)
    fa = rn(M, r).to(dtype)
    f_b = (rn(h * k, r) / r ** 0.5).to(dtype)
    b = rn(M, h).to(dtype)
    a_log, dt_bias = 0.5 * rn(h), 0.5 * rn(h * k)
    state = 0.5 * rn(M, h, k, k)
    return [t.to(device) for t in (x, conv_state, conv_w, fa, f_b, b, a_log, dt_bias, state)]


def _two_steps(fn, variant, args):
    """Two steps of the compiled fn and of eager from copies of the same states: (got, want, states)."""
    st_c = [args[1].clone(), args[8].clone()]
    st_e = [args[1].clone(), args[8].clone()]
    x = args[0]
    for _ in range(2):   # the second step reads the states the first wrote
        want = _step(variant)(x, st_e[0], *args[2:8], st_e[1])
        got = fn(x, st_c[0], *args[2:8], st_c[1])
        x = x.roll(1, 0)
    return got, want, st_c, st_e


def check_site(name, why, got, want, st_c, st_e):
    """The pass `name` matched the one site exactly (why None: the output and both states equal eager
    bit for bit, the op's reference being the model's math), or missed it with `why` in its reason, or
    (why "needs ...": a pass it anchors on was left out) was skipped with that reason."""
    rep = k3compile.last_report()
    p = rep.get(name)
    skip = why is not None and why.startswith("needs ")
    assert p.expected == 1 and p.error is None and (p.skipped is None) != skip, rep.render()
    if skip:
        assert why in p.skipped and p.matched == 0 and not p.near_misses, rep.render()
        tol = {}
    elif why is None:
        assert p.matched == 1 and not p.near_misses
        tol = dict(rtol=0, atol=0)       # the op's reference is the model's math
    else:
        assert p.matched == 0 and len(p.near_misses) == 1, p.near_misses
        assert why in p.near_misses[0].reason, p.near_misses[0].reason
        tol = {}
    torch.testing.assert_close(got, want, **tol)
    for c, e in zip(st_c, st_e):
        torch.testing.assert_close(c, e, **tol)


@pytest.mark.parametrize("variant, passes, why", [
    ("model", FOLDS, None),
    ("model", ["fold_kda_gate", "fold_kda_conv", "fold_kda_step"], "needs fold_kda_fb's ops"),
    ("conv q reused", FOLDS, "read elsewhere too"),
])
def test_fold_kda_step_matches_the_step_or_says_why(variant, passes, why):
    args = _inputs()
    fn = torch.compile(_step(variant), backend=k3compile.backend(mode="eager", passes=passes), fullgraph=True,
                       dynamic=False)
    got, want, st_c, st_e = _two_steps(fn, variant, args)
    check_site("fold_kda_step", why, got, want, st_c, st_e)


@pytest.mark.parametrize("v2", [True, False])
def test_both_states_are_updated_in_place_under_inductor(v2):
    """With Inductor (CPU codegen) the auto_functionalized k3::kda_step_decode_ becomes the in-place call
    on both state inputs: no clone of either and no copy into either; two steps equal eager exactly.
    v2=False: Inductor's enable_auto_functionalized_v2 off (as vLLM sets it)."""
    from torch._inductor.utils import run_and_get_code
    args = _inputs()
    cs_e, st_e = args[1].clone(), args[8].clone()
    fn = torch.compile(_step(), backend=k3compile.backend(passes=FOLDS, gate="off"), fullgraph=True, dynamic=False)
    x = args[0]
    for i in range(2):
        if i == 0:   # caches off: the passes must run here
            with torch._inductor.config.patch(enable_auto_functionalized_v2=v2, force_disable_caches=True):
                got, codes = run_and_get_code(fn, x, *args[1:])
            assert k3compile.last_report().get("fold_kda_step").matched == 1
        else:
            got = fn(x, *args[1:])
        want = _step()(x, cs_e, *args[2:8], st_e)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(args[1], cs_e, rtol=0, atol=0)
        torch.testing.assert_close(args[8], st_e, rtol=0, atol=0)
        x = x.roll(1, 0)
    code = "\n".join(codes)
    call = re.search(r"torch\.ops\.k3\.kda_step_decode_\.default\((.*)\)", code)
    assert call, code
    bases = re.findall(r"\barg\d+_1\b", call.group(1))
    assert len(set(bases)) >= 2, call.group(0)
    for b in set(bases):
        assert f"{b}.copy_" not in code and f"clone({b}" not in code, (b, code)
    assert "kda_conv_decode" not in code and "kda_decode_fb" not in code


def _err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _kernel_args(M, dtype, device, seed, h, k, r):
    """The op's arguments with xq, xk, xv as column slices of one wider projection output (the in_proj
    split's layout) and a random conv state and state."""
    x, cs, w, fa, f_b, b, a_log, dt_bias, st = _inputs(M, dtype, device, seed, h, k, r)
    wide = torch.cat([x, x[:, :5]], 1)
    xq, xk, xv = wide[:, :h * k], wide[:, h * k:2 * h * k], wide[:, 2 * h * k:3 * h * k]
    return [xq, xk, xv, w, fa, f_b, b, a_log, dt_bias, cs, st]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's CPU interpreter (no-GPU machines)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, h, k, r, p", [(3, 2, 16, 16, "4"), (2, 3, 64, 32, "2"), (1, 2, 128, 128, "4"),
                                           (2, 2, 128, 32, "1")])
def test_kernel_matches_reference_in_the_interpreter(monkeypatch, dtype, M, h, k, r, p):
    """attention.kda_step_decode against the op's reference: o, the state and the conv state (both in
    place); 1, 2 or 4 programs per head (the counters left at zero)."""
    pytest.importorskip("triton")
    from k3compile.kernels import attention, gemm
    monkeypatch.setenv("K3_KNOBS", knobs_text(kda_step_p=p))
    args = _kernel_args(M, dtype, "cpu", M + k, h, k, r)
    consts = (-5.0, k ** -0.5, 1e-12, dtype)
    mine = [t.clone() for t in args[9:]]
    assert attention.kda_step_decode_fits(*args[:9], *mine)
    want = ref.kda_step_decode_(*args, *consts)
    ptrs = [t.data_ptr() for t in mine]
    got = attention.kda_step_decode(*args[:9], *mine, *consts)
    assert [t.data_ptr() for t in mine] == ptrs and got.dtype == args[2].dtype and got.shape == want.shape
    torch.testing.assert_close(mine[0], args[9], rtol=0, atol=0)     # the shifted window: copied values
    tol = 1e-5 if dtype == torch.float32 else 1e-4   # fp16: a normed q / k may round to its neighbour
    assert _err(got, want) < tol and _err(mine[1], args[10]) < tol, (_err(got, want), _err(mine[1], args[10]))
    cnt = gemm.split_counters(torch.device("cpu"))
    assert cnt is None or not cnt.any()


def test_kernel_refuses_what_it_cannot_take():
    """kda_step_decode_fits says no (the op then runs its reference) where the kernel does not apply."""
    from k3compile.kernels import attention
    args = _kernel_args(2, torch.bfloat16, "cpu", 0, H, K, R)
    assert attention.kda_step_decode_fits(*args)
    bad = {
        "conv width 3": lambda a: [*a[:3], a[3][:, :3].contiguous(), *a[4:9], a[9][..., :2].contiguous(), a[10]],
        "conv state strided": lambda a: [*a[:9], a[9].transpose(0, 1).contiguous().transpose(0, 1), a[10]],
        "f_b of another shape": lambda a: [*a[:5], a[5][:-1], *a[6:]],
        "state bf16": lambda a: [*a[:10], a[10].bfloat16()],
        "conv weight of another dtype": lambda a: [*a[:3], a[3].float(), *a[4:]],
    }
    for why, change in bad.items():
        assert not attention.kda_step_decode_fits(*change(args)), why


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("p", ["4", "1"])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_kda_step_on_cuda_at_real_widths_repeated_and_graphed(monkeypatch, M, p):
    """The Triton kernel at a TP=8 rank's KDA widths (12 heads of 128, rank 128), bf16, from random
    states, against the reference on CPU, over three steps in a row (each reading the states the last
    wrote: a program that read a shifted window, or a counter not put back to zero, shows), then one
    step replayed from a CUDA graph. At M=16, 4 programs per head are 768 programs: not all resident."""
    from k3compile.kernels import dispatch, gemm
    monkeypatch.setenv("K3_KNOBS", knobs_text(kda_step_p=p))
    args = _kernel_args(M, torch.bfloat16, "cuda", 5 + M, 12, 128, 128)
    consts = (-5.0, 128 ** -0.5, 1e-12, torch.bfloat16)
    k = dispatch.pick("kda_step_decode_", "cuda", *args, *consts)
    assert k is not None and k.name == "triton_kda_step"
    mine = [t.clone() for t in args[9:]]
    theirs = [t.cpu() for t in args[9:]]
    cpu_in = [t.cpu() for t in args[:9]]
    for step in range(3):
        want = ref.kda_step_decode_(*cpu_in, *theirs, *consts)
        got = torch.ops.k3.kda_step_decode_(*args[:9], *mine, *consts)
        torch.cuda.synchronize()
        # bf16 sums in another order: f and the normed q, k may round to the neighbouring value
        assert torch.equal(mine[0].cpu(), theirs[0]), step
        assert _err(got.cpu(), want) < 1e-2 and _err(mine[1].cpu(), theirs[1]) < 1e-2, \
            (step, _err(got.cpu(), want), _err(mine[1].cpu(), theirs[1]))
        mine[1].copy_(theirs[1])   # the next step from the same state on both sides
    cnt = gemm.split_counters(args[0].device)
    assert cnt is not None and not cnt.any()
    from _cuda_graph import replay_once
    cs0, st0 = mine[0].cpu(), mine[1].cpu()
    want = ref.kda_step_decode_(*cpu_in, cs0, st0, *consts)    # cs0, st0 now hold the new states
    out, (cs_g, st_g) = replay_once(lambda cs, st: torch.ops.k3.kda_step_decode_(*args[:9], cs, st, *consts),
                                    mine[0], mine[1])
    assert torch.equal(cs_g.cpu(), cs0)
    assert _err(out.cpu(), want) < 1e-2 and _err(st_g.cpu(), st0) < 1e-2, (_err(out.cpu(), want), _err(st_g.cpu(), st0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_fold_kda_step_on_cuda_under_inductor(mode):
    """The compiled step at real widths on CUDA with the four KDA folds let through the gate, eagerly
    and as CUDA graphs (reduce-overhead): three steps against eager, each reading the states the last
    wrote; the output within 2e-2 of its max (fla's recurrence in eager), the conv state exactly."""
    h, k, r = 12, 128, 128
    args = _inputs(M=1, dtype=torch.bfloat16, device="cuda", seed=3, h=h, k=k, r=r)
    cs_e, st_e = args[1].clone(), args[8].clone()
    fn = torch.compile(_step(h=h, k=k), backend=k3compile.backend(passes=FOLDS, ungated=FOLDS), mode=mode,
                       fullgraph=True, dynamic=False)
    x = args[0]
    for i in range(3):
        with torch._inductor.config.patch(force_disable_caches=i == 0):
            got = fn(x, *args[1:]).clone()
        want = _step(h=h, k=k)(x, cs_e, *args[2:8], st_e)
        assert _err(got, want) < 2e-2 and _err(args[8], st_e) < 2e-2, (i, _err(got, want), _err(args[8], st_e))
        assert torch.equal(args[1], cs_e), i
        x = x * 0.9 + 0.1
    p = k3compile.last_report().get("fold_kda_step")
    assert p.matched == p.expected == 1, k3compile.last_report().render()
