"""The k3 backend's matching does not depend on how a decoder is written: property tests over the
mixed-spelling K3 decoder (tests/others/mixed.py), where the spelling of every component (GEMM form,
RMSNorm form and rounding order, residual add, all-reduce form, router renormalisation, MoE finalize,
latent-tail add, AttnRes mixer and its logits' rounding) is chosen PER LAYER.

For each drawn spelling (one dict per layer, 4 layers: KDA dense, KDA MoE, MLA MoE, KDA MoE) the
match report sees 4 attention / 3 MoE layers, every site of the six passes below matches, and the
compiled logits equal eager's BIT FOR BIT: the fused ops round as the model's norms and mixers do
(patterns record the order, the ops' references follow it). The one exception is a plain-torch
expert computation that lower_mxfp4_experts replaces by k3::mxfp4_experts (dequant "table_const" /
"bits"): that op's own numerics, held to bf16 tolerance (as tests/test_others_k3.py). The backend
runs in its eager mode (CPU references).
"""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.others import mixed as MX  # noqa: E402
from tests.others import run as R  # noqa: E402

from tests.others.run import EXPECTED, LAYERS, MOE  # noqa: E402

# One fixed spelling per layer that uses every value of every key at least once (world 2 test), but
# norm="in_dtype" and "fused_rms_norm" (six norm spellings, four layers; test_rounding_orders_per_layer_are_exact
# has the first, tests/test_inductor_forms.py the second).
VARIED = [
    dict(gemm="linear", norm="rms_norm", residual="prefix_delta", allreduce="funcol", mixer="stack_softmax",
         keys="rounded"),
    dict(gemm="matmul_op", norm="rsqrt_after", residual="delta_prefix", allreduce="c10d",
         renorm="plain", finalize="mul_sum", tail="pad", mixer="unrolled", keys="fp32", dequant="table_const"),
    dict(gemm="matmul_fn", norm="sqrt_before", residual="torch_add", allreduce="inplace",
         renorm="eps", finalize="bmm", tail="slice_iadd", mixer="stack_softmax", keys="weighted", router="fp32",
         shared="split", dequant="bits"),
    dict(gemm="mm", norm="module_recip", residual="torch_add", allreduce="funcol",
         renorm="scale", finalize="einsum", tail="narrow_add_", mixer="unrolled", keys="fp32", router="bf16",
         shared="fused", dequant="table_input"),
]


def _tol(ref):
    return 2e-2 * ref.abs().max().item() + 1e-2


def _lowers_experts(spellings) -> bool:
    """Whether lower_mxfp4_experts replaces a layer's plain-torch experts (a dequantisation whose value
    table is known when compiling): k3::mxfp4_experts then computes them with its own numerics."""
    return any(sp.get("dequant", MX.DEFAULT["dequant"]) != "table_input" for sp in spellings[1:])


def _layer_spelling(world):
    """One layer's spelling dict: every key (but the all-reduce form at TP=1)."""
    keys = [k for k in MX.SPELLINGS if world > 1 or k != "allreduce"]
    return st.fixed_dictionaries({k: st.sampled_from(MX.SPELLINGS[k]) for k in keys})


def _fmt(spellings):
    return "\n".join(f"  layer {i}: {s}" for i, s in enumerate(spellings))


def check(spellings, eager, compiled, rep, world, M, expected=EXPECTED):
    where = f"TP={world} M={M} spellings:\n{_fmt(spellings)}"
    assert rep is not None, f"no k3 report: the backend did not run; {where}"
    st_ = rep["structure"]
    assert (st_["attention_layers"], st_["moe_layers"], st_["tp"], st_["m"]) == (LAYERS, MOE, world, M), \
        f"structure {st_}; {where}"
    by = {p["name"]: p for p in rep["passes"]}
    bad = []
    for name, n in expected.items():
        p = by[name]
        if (p["matched"], p["expected"]) != (n, n):
            nms = "\n".join(f"      at {nm['site']}: stopped at {nm['stopped_at']}: {nm['reason']}"
                            for nm in p["near_misses"])
            bad.append(f"  {name}: matched {p['matched']} expected {p['expected']} (want {n}); "
                       f"skipped={p['skipped']} error={p['error']}; near-misses:\n{nms}")
    # plain-torch experts: lowered where the dequantisation's value table is a constant or there is
    # none; a table passed in as a graph input is a near-miss (its values are unknown when compiling)
    lowered = sum(sp.get("dequant", "table_input") != "table_input" for sp in spellings[1:])   # layers 1-3: MoE
    p = by["lower_mxfp4_experts"]
    if (p["matched"], p["expected"]) != (lowered, MOE) or not all(
            "values are not known when compiling" in nm["reason"] for nm in p["near_misses"]):
        bad.append(f"  lower_mxfp4_experts: matched {p['matched']} expected {p['expected']} (want {lowered} of "
                   f"{MOE}); near-misses: {[nm['reason'] for nm in p['near_misses']]}")
    assert not bad, "passes did not match every site:\n" + "\n".join(bad) + f"\n{where}"
    err = (compiled - eager).abs().max().item()
    if not _lowers_experts(spellings):
        assert torch.equal(compiled, eager), f"compiled logits differ from eager's (max abs err {err:.4g}); {where}"
    assert err <= _tol(eager), f"max abs err {err:.4g} > {_tol(eager):.4g}; {where}"


def test_every_spelling_is_the_same_function():
    """Eager only: each spelling value (all 4 layers spelled alike) computes functional.py's logits
    from the same weights (bit for bit with functional.py's own spellings); the mixed VARIED too."""
    M = 3
    ref = R.run("functional", 1, 0, M, steps=2)[0]
    same = MX.run([MX.FUNCTIONAL] * LAYERS, M=M, backend=None, report=False)[0]
    assert torch.equal(same, ref)
    cases = [(f"{k}={v}", [dict(MX.DEFAULT, **{k: v})] * LAYERS)
             for k, vs in MX.SPELLINGS.items() if k != "allreduce" for v in vs]
    cases.append(("VARIED", VARIED))
    for what, sps in cases:
        out = MX.run(sps, M=M, backend=None, report=False)[0]
        err = (out - ref).abs().max().item()
        assert err <= _tol(ref), f"{what}: eager differs from functional.py by {err:.4g} > {_tol(ref):.4g}"


# Each norm spelling once, with the AttnRes logits and mixer forms spread over them: written per layer
# (the final mixer takes the last layer's); at TP=1 the compiled logits equal eager's bit for bit.
ROUNDINGS = [
    [dict(MX.DEFAULT, norm="rsqrt_after", keys="fp32", mixer="stack_softmax"),
     dict(MX.DEFAULT, norm="rms_norm", keys="rounded", mixer="unrolled"),
     dict(MX.DEFAULT, norm="module_recip", keys="weighted", mixer="stack_softmax"),
     dict(MX.DEFAULT, norm="in_dtype", keys="fp32", mixer="unrolled")],
    [dict(MX.DEFAULT, norm="sqrt_before", keys="rounded", mixer="stack_softmax"),
     dict(MX.DEFAULT, norm="in_dtype", keys="weighted", mixer="unrolled"),
     dict(MX.DEFAULT, norm="rsqrt_after", keys="rounded", mixer="unrolled"),
     dict(MX.DEFAULT, norm="rsqrt_after", keys="weighted", mixer="stack_softmax")],
]


@pytest.mark.parametrize("case", range(len(ROUNDINGS)))
def test_rounding_orders_per_layer_are_exact(case):
    """The RMSNorm rounding orders (the weight applied in fp32 then one rounding, as F.rms_norm; rounded
    to bf16 first and then multiplied by the bf16 weight, as transformers' modules; x / sqrt,
    x * (1 / sqrt); every step in bf16) and the AttnRes logits (keys rounded, kept in fp32, or normed
    with w_norm as their weight; softmax or unrolled), mixed per layer: every site matches and the
    compiled logits are eager's, bit for bit, at M=3 (TP=1)."""
    spellings, M = ROUNDINGS[case], 3
    eager, compiled, rep = MX.run(spellings, world=1, M=M, steps=2)
    check(spellings, eager, compiled, rep, 1, M)


def _property_test(fn):
    fn = given(spellings=st.lists(_layer_spelling(1), min_size=LAYERS, max_size=LAYERS),
               M=st.sampled_from([1, 3]))(fn)
    return settings(max_examples=4, deadline=None, derandomize=True, print_blob=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])(fn)


@pytest.mark.slow
@_property_test
def test_random_spellings_tp1(spellings, M):
    """Hypothesis draws one spelling dict per layer and M in {1, 3}; every site matches, the logits are
    eager's (bit for bit where no experts are lowered)."""
    note(f"M={M} spellings:\n{_fmt(spellings)}")
    print(f"drawn: M={M} spellings:\n{_fmt(spellings)}")        # shown with pytest -s
    eager, compiled, rep = MX.run(spellings, world=1, M=M, steps=2)
    check(spellings, eager, compiled, rep, 1, M)


@pytest.mark.slow
def test_varied_spellings_tp2():
    """Two gloo ranks, VARIED (every spelling value somewhere, all three all-reduce forms); rank 0's
    report and logits (VARIED lowers plain-torch experts: bf16 tolerance)."""
    M = 3
    eager, compiled, rep = MX.launch_many([dict(spellings=VARIED, M=M, steps=2)], world=2)[0]
    check(VARIED, eager, compiled, rep, 2, M)


def test_fp32_router_and_split_shared_expert(monkeypatch):
    """Layer 2's router GEMM in fp32 (`torch.matmul(x.float(), W.float().T)`) and its shared expert as
    separate gate and up GEMMs: every site matches; the sharded router op keeps the fp32 logits (its
    router_fp32 argument) and the side-stream shared expert takes both weights."""
    from k3compile.ops import reference as ref
    calls = {"router_fp32": [], "w_up": []}
    router, shared = ref.router_latent_sharded, ref.shared_expert_split

    def router_spy(*a):
        calls["router_fp32"].append(a[6])
        return router(*a)

    def shared_spy(*a):
        calls["w_up"].append(a[5] is not None)
        return shared(*a)
    monkeypatch.setattr(ref, "router_latent_sharded", router_spy)
    monkeypatch.setattr(ref, "shared_expert_split", shared_spy)
    sps = [dict(s) for s in VARIED]
    for s in sps:
        s.pop("allreduce")
    M, steps = 3, 2
    eager, compiled, rep = MX.run(sps, world=1, M=M, steps=steps)
    check(sps, eager, compiled, rep, 1, M)
    # per compiled step, one MoE layer (layer 2) is the fp32 / split one (the other layers' ops may be
    # folded further by the TP=1 folds, so they need not call these references)
    assert calls["router_fp32"].count(True) == steps, calls
    assert calls["w_up"].count(True) == steps, calls
