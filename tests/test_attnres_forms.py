"""patterns.attnres: the AttnRes mixer (spec section 2) recognised in any spelling of its math.

Small standalone mixer functions, each a different way to write
    updated = prefix + delta; srcs = [blocks..., updated]
    mixed = sum_s softmax_s(sum_h RMSNorm(src_s) * w_norm * w_qk) * src_s;  out = RMSNorm(mixed) * g
are captured as the post-grad ATen graph the k3 passes see (aot_autograd with Inductor's
decompositions), and `match_attnres_from_norm` on the final norm must name `updated`, the blocks
and the two weights; formulas that differ from the spec (softmax over the hidden dim, a missing
w_qk factor, a mean instead of a sum) must Fail; a plain RMSNorm stays the plain form. The site also
records how the mixer and its norms round (mix_rounding, norm.rounding): the fused ops' reference
(ops.reference.attnres_mix_as) in those orders must give each form's eager output bit for bit.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table

from k3compile.model.functional import attnres_mix, rms_norm
from k3compile.patterns.attnres import AttnResSite, match_attnres_from_norm
from k3compile.patterns.graph import Fail, dtype, is_call, rms_norms_by_input, aten

M, H, EPS = 3, 64, 1e-5


# ------------------------------------------------------------------------------------------ capture
def capture(fn, inputs: dict, dynamic_m: bool = False):
    """(post-grad ATen graph of fn(**inputs), {input name: its placeholder})."""
    got = {}

    def fw(gm, _example):
        got["gm"] = gm

        def run(*args):
            got["args"] = args
            return gm.forward(*args)
        return make_boxed_func(run)

    names = list(inputs)
    if dynamic_m:
        for v in inputs.values():
            if v.dim() == 2:
                torch._dynamo.mark_dynamic(v, 0)
    compiled = torch.compile(lambda *a: fn(**dict(zip(names, a))), fullgraph=True,
                             backend=aot_autograd(fw_compiler=fw, decompositions=select_decomp_table()))
    with torch.no_grad():
        compiled(*inputs.values())
    gm = got["gm"]
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_ptr = {v.data_ptr(): k for k, v in inputs.items()}
    named = {}
    for ph, a in zip(phs, got["args"]):
        if isinstance(a, torch.Tensor) and a.data_ptr() in by_ptr:
            named[by_ptr[a.data_ptr()]] = ph
    return gm, named


def final_norm_site(gm, g_node):
    """The RMSNorm whose weight is the placeholder g, and match_attnres_from_norm on it."""
    sites = [s for ss in rms_norms_by_input(gm.graph).values() for s in ss if s.weight is g_node]
    assert sites, "no final RMSNorm found"
    return [match_attnres_from_norm(s) for s in sites]


def make_inputs(nblocks: int, dt=torch.bfloat16, seed=0, buffer=False):
    gen = torch.Generator().manual_seed(seed)
    d = {"prefix": torch.randn(M, H, generator=gen).to(dt), "delta": torch.randn(M, H, generator=gen).to(dt)}
    for i in range(nblocks):
        d[f"b{i}"] = (torch.randn(M, H, generator=gen) * (1 + i)).to(dt)
    d["w_norm"] = (1 + 0.2 * torch.randn(H, generator=gen)).to(dt)
    d["w_qk"] = (torch.randn(H, generator=gen) / H ** 0.5).to(dt)
    d["g"] = (1 + 0.1 * torch.randn(H, generator=gen)).to(dt)
    if buffer:   # a preallocated block buffer (the "fused" style): blocks written in, then `updated`
        d["buf"] = torch.zeros(nblocks + 2, M, H, dtype=dt)
    return d


def _blocks(kw):
    return [kw[k] for k in sorted(k for k in kw if k.startswith("b") and k[1:].isdigit())]


# ------------------------------------------------------------------------------------------ spellings
def _hand_rms(x, eps=EPS):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def form_reference(prefix, delta, w_norm, w_qk, g, **kw):
    """The project's own model (stack, softmax, sum over stacked sources)."""
    return attnres_mix(prefix, delta, _blocks(kw), w_norm, w_qk, g, EPS)[0]


def form_cat_reshape(prefix, delta, w_norm, w_qk, g, **kw):
    updated = prefix + delta
    bl = _blocks(kw)
    if not bl:
        return rms_norm(updated, g, EPS)
    srcs = torch.cat([*bl, updated], 0).reshape(len(bl) + 1, M, H)
    logits = (_hand_rms(srcs) * w_norm.float() * w_qk.float()).sum(-1)
    p = torch.softmax(logits, 0)
    return rms_norm((p.unsqueeze(-1) * srcs.float()).sum(0).to(updated.dtype), g, EPS)


def form_unrolled(prefix, delta, w_norm, w_qk, g, **kw):
    """A Python loop over the sources: running max (torch.maximum), exp, num / den."""
    updated = delta + prefix
    sources = _blocks(kw) + [updated]
    if len(sources) == 1:
        return rms_norm(updated, g, EPS)
    query = w_qk.float()
    logits = [(rms_norm(s, w_norm, EPS).float() * query).sum(-1) for s in sources]
    mx = logits[0]
    for lg in logits[1:]:
        mx = torch.maximum(mx, lg)
    num = den = None
    for lg, s in zip(logits, sources):
        e = torch.exp(lg - mx)
        t = e.unsqueeze(-1) * s.float()
        num = t if num is None else num + t
        den = e if den is None else den + e
    return rms_norm((num / den.unsqueeze(-1)).to(updated.dtype), g, EPS)


def form_f_rms_norm(prefix, delta, w_norm, w_qk, g, **kw):
    """HF style: the key norm is F.rms_norm with w_norm as its weight, then * w_qk; F.rms_norm at the end."""
    updated = prefix + delta
    bl = _blocks(kw)
    if not bl:
        return F.rms_norm(updated, (H,), g, EPS)
    srcs = torch.stack([*bl, updated], 0)
    logits = (F.rms_norm(srcs, (H,), w_norm, EPS).float() * w_qk.float()).sum(-1)
    mixed = (torch.softmax(logits, 0).unsqueeze(-1) * srcs.float()).sum(0).to(updated.dtype)
    return F.rms_norm(mixed, (H,), g, EPS)


def form_swapped_weights(prefix, delta, w_norm, w_qk, g, **kw):
    """Hand-written rsqrt norm; the weights multiplied the other way round, w_qk first."""
    updated = prefix + delta
    srcs = torch.stack([*_blocks(kw), updated], 0)
    logits = (w_qk.float() * (w_norm.float() * _hand_rms(srcs))).sum(-1)
    mixed = (torch.softmax(logits, 0).unsqueeze(-1) * srcs.float()).sum(0).to(updated.dtype)
    return rms_norm(mixed, g, EPS)


def form_einsum_buffer(prefix, delta, w_norm, w_qk, g, buf, **kw):
    """Research style: blocks copied into a preallocated buffer, `updated` into the next slot, the
    mixer over buf[:n+1] with einsums, div-by-sqrt norms with the weight first."""
    def rn(x, w):
        xf = x.float()
        return (w.float() * (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + EPS))).to(x.dtype)
    bl = _blocks(kw)
    for i, b in enumerate(bl):
        buf[i].copy_(b)
    updated = prefix + delta
    n = len(bl)
    buf[n].copy_(updated)
    src = buf[: n + 1]
    logits = torch.einsum("smh,h->sm", rn(src, w_norm).float(), w_qk.float())
    mixed = torch.einsum("sm,smh->mh", logits.softmax(0), src.float()).to(updated.dtype)
    return rn(mixed, g)


def form_logsumexp_terms(prefix, delta, w_norm, w_qk, g, **kw):
    """p = exp(logits - logsumexp(logits)); the weighted sum as a Python sum of per-source terms."""
    updated = prefix + delta
    sources = [*_blocks(kw), updated]
    srcs = torch.stack(sources)
    logits = (_hand_rms(srcs) * (w_norm.float() * w_qk.float())).sum(-1)
    p = torch.exp(logits - torch.logsumexp(logits, 0, keepdim=True))
    mixed = sum(p[i].unsqueeze(-1) * s.float() for i, s in enumerate(sources))
    return rms_norm(mixed.to(updated.dtype), g, EPS)


def form_online_softmax(prefix, delta, w_norm, w_qk, g, **kw):
    """The softmax in Inductor's CUDA post-grad form (prims.prepare_softmax_online), the key norm with
    w_norm as its weight (so the structural parse does not take it)."""
    from torch._inductor import inductor_prims  # noqa: F401  (registers prims.prepare_softmax_online)
    updated = prefix + delta
    srcs = torch.stack([*_blocks(kw), updated], 0)
    logits = (rms_norm(srcs, w_norm, EPS).float() * w_qk.float()).sum(-1)
    mx, sm = torch.ops.prims.prepare_softmax_online(logits, 0)
    p = torch.exp(logits - mx) / sm
    return rms_norm((p.unsqueeze(-1) * srcs.float()).sum(0).to(updated.dtype), g, EPS)


def _hf_rms(x, w, eps=EPS):
    """transformers' RMSNorm module: fp32 statistics, cast back, THEN the weight (in the model dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def form_hf_modules(prefix, delta, w_norm, w_qk, g, **kw):
    """transformers style throughout: the key norm and the output norm are `weight * h.to(dtype)`."""
    updated = prefix + delta
    bl = _blocks(kw)
    if not bl:
        return _hf_rms(updated, g)
    srcs = torch.stack([*bl, updated], 0)
    logits = (_hf_rms(srcs, w_norm).float() * w_qk.float()).sum(-1)
    mixed = (torch.softmax(logits, 0).unsqueeze(-1) * srcs.float()).sum(0).to(updated.dtype)
    return _hf_rms(mixed, g)


def form_fp32_keys(prefix, delta, w_norm, w_qk, g, **kw):
    """Research style: the stacked sources upcast once, their keys kept in fp32 times w_norm * w_qk; the
    output norm transformers-style."""
    updated = prefix + delta
    bl = _blocks(kw)
    if not bl:
        return _hf_rms(updated, g)
    src = torch.stack([*bl, updated], 0).float()
    nrm = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + EPS)
    logits = (nrm * (w_norm.float() * w_qk.float())).sum(-1)
    mixed = (torch.softmax(logits, 0).unsqueeze(-1) * src).sum(0).to(updated.dtype)
    return _hf_rms(mixed, g)


def form_in_dtype(prefix, delta, w_norm, w_qk, g, **kw):
    """Every norm in the model dtype (no fp32 upcast), unrolled, 1 / sqrt."""
    def rn(x, w):
        y = x * (1.0 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS))
        return y * w
    updated = prefix + delta
    sources = _blocks(kw) + [updated]
    if len(sources) == 1:
        return rn(updated, g)
    logits = [(rn(s, w_norm).float() * w_qk.float()).sum(-1) for s in sources]
    mx = logits[0]
    for lg in logits[1:]:
        mx = torch.maximum(mx, lg)
    num = den = None
    for lg, s in zip(logits, sources):
        e = torch.exp(lg - mx)
        num = e.unsqueeze(-1) * s.float() if num is None else num + e.unsqueeze(-1) * s.float()
        den = e if den is None else den + e
    return rn((num / den.unsqueeze(-1)).to(updated.dtype), g)


FORMS = {
    "reference": form_reference,
    "cat_reshape": form_cat_reshape,
    "unrolled": form_unrolled,
    "f_rms_norm": form_f_rms_norm,
    "swapped_weights": form_swapped_weights,
    "einsum_buffer": form_einsum_buffer,
    "logsumexp_terms": form_logsumexp_terms,
    "online_softmax": form_online_softmax,
    "hf_modules": form_hf_modules,
    "fp32_keys": form_fp32_keys,
    "in_dtype": form_in_dtype,
}


def _check_site(site, named, nblocks):
    assert isinstance(site, AttnResSite), getattr(site, "reason", site)
    upd = site.updated
    assert is_call(upd, aten.add.Tensor) and {*upd.args[:2]} == {named["prefix"], named["delta"]}, upd
    want_blocks = [named[f"b{i}"] for i in range(nblocks)]
    assert set(site.blocks) == set(want_blocks) and len(site.blocks) == nblocks, (site.blocks, want_blocks)
    assert site.blocks == sorted(site.blocks, key=lambda n: n._sort_key)   # oldest first, graph order
    if nblocks:
        assert {site.w_norm, site.w_qk} == {named["w_norm"], named["w_qk"]}, (site.w_norm, site.w_qk)
    # the site's output is in the residual stream's dtype (where a consumer upcasts, not at the upcast)
    assert dtype(site.norm.out) == dtype(upd)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("nblocks, dt", [(1, torch.bfloat16), (3, torch.bfloat16), (2, torch.float32)])
def test_mixer_forms_match(form, nblocks, dt):
    kw = make_inputs(nblocks, dt, buffer=form == "einsum_buffer")
    gm, named = capture(FORMS[form], kw)
    sites = final_norm_site(gm, named["g"])
    for site in sites:
        _check_site(site, named, nblocks)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("nblocks", [0, 1, 3])
def test_site_rounding_reproduces_the_form_bit_for_bit(form, nblocks):
    """The orders the site records (norm.rounding, mix_rounding) make the fused ops' reference compute
    exactly what the form computes in bf16: ops.reference.attnres_mix_as over the site's blocks and
    weights equals the form's eager output bit for bit (for forms written otherwise than the reference
    model, the reference model's order differs from it)."""
    from k3compile.ops import reference as ref
    if nblocks == 0 and form in ("einsum_buffer", "swapped_weights", "cat_reshape", "logsumexp_terms",
                                 "online_softmax"):
        pytest.skip("the form needs blocks")
    torch._dynamo.reset()
    kw = make_inputs(nblocks, torch.bfloat16, seed=2 + nblocks, buffer=form == "einsum_buffer")
    gm, named = capture(FORMS[form], {k: v.clone() for k, v in kw.items()})
    with torch.no_grad():
        eager = FORMS[form](**{k: v.clone() for k, v in kw.items()})
    by_node = {ph: kw[name] for name, ph in named.items()}
    sites = final_norm_site(gm, named["g"])
    for site in sites:
        _check_site(site, named, nblocks)
        args = (kw["prefix"], kw["delta"], [by_node[b] for b in site.blocks], by_node.get(site.w_norm),
                by_node.get(site.w_qk), kw["g"], site.norm.eps)
        out, _ = ref.attnres_mix_as(*args, site.norm.rounding, site.mix_rounding)
        assert torch.equal(out, eager), (form, nblocks, site.norm.rounding, site.mix_rounding,
                                         int((out != eager).sum()), (out.float() - eager.float()).abs().max())
        if form in ("hf_modules", "fp32_keys", "in_dtype") or (nblocks and form in ("unrolled", "einsum_buffer")):
            assert not torch.equal(ref.attnres_mix_as(*args, 0, 0)[0], eager), "the orders do not matter here"


@pytest.mark.parametrize("spelling, rounding", [
    ("F.rms_norm", 0), ("nn.RMSNorm", 0), ("fp32 weight", 0), ("transformers", 1), ("div", 2), ("recip", 4),
    ("transformers recip", 5), ("in dtype", 8)])
def test_norm_rounding_order_is_recorded(spelling, rounding):
    """match_rms_norm names the rounding order of each RMSNorm spelling (ops.reference's NORM_* bits:
    1 rounded before the weight multiply, 2 x / sqrt, 4 x * (1 / sqrt), 8 all in bf16), and
    ops.reference.rms_norm_as in that order is the spelling's eager output bit for bit. F.rms_norm and
    nn.RMSNorm in eager (CPU, bf16 input and weight) apply the weight in fp32 and round once."""
    from k3compile.ops import reference as ref
    mod = torch.nn.RMSNorm(H, eps=EPS).to(torch.bfloat16)

    def fn(x, w):
        xf = x.float()
        ms = xf.pow(2).mean(-1, keepdim=True) + EPS
        if spelling == "F.rms_norm":
            return F.rms_norm(x, (H,), w, EPS)
        if spelling == "nn.RMSNorm":
            mod.weight.data.copy_(w)
            return mod(x)
        if spelling == "fp32 weight":
            return (xf * torch.rsqrt(ms) * w.float()).to(x.dtype)
        if spelling == "transformers":
            return w * (xf * torch.rsqrt(ms)).to(x.dtype)
        if spelling == "div":
            return (w.float() * (xf / torch.sqrt(ms))).to(x.dtype)
        if spelling == "recip":
            return (xf * (1.0 / torch.sqrt(ms)) * w.float()).to(x.dtype)
        if spelling == "transformers recip":
            return w * (xf * (1.0 / torch.sqrt(ms))).to(x.dtype)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
    gen = torch.Generator().manual_seed(5)
    kw = {"x": (torch.randn(16, H, generator=gen) * 3).to(torch.bfloat16),
          "w": (1 + 0.3 * torch.randn(H, generator=gen)).to(torch.bfloat16)}
    torch._dynamo.reset()
    gm, named = capture(fn, kw)
    with torch.no_grad():
        eager = fn(**kw)
    sites = [s for ss in rms_norms_by_input(gm.graph).values() for s in ss if s.weight is not None]
    assert len(sites) == 1, sites
    assert sites[0].rounding == rounding, (spelling, sites[0].rounding)
    assert torch.equal(ref.rms_norm_as(kw["x"], kw["w"], sites[0].eps, rounding), eager)
    if rounding & 1:
        assert not torch.equal(ref.rms_norm_as(kw["x"], kw["w"], sites[0].eps, 0), eager)


@pytest.mark.parametrize("form", ["reference", "unrolled", "f_rms_norm"])
def test_no_blocks_is_the_plain_residual_norm(form):
    kw = make_inputs(0)
    gm, named = capture(FORMS[form], kw)
    for site in final_norm_site(gm, named["g"]):
        _check_site(site, named, 0)
        assert site.w_norm is None and site.w_qk is None


def test_unrolled_mixer_with_all_blocks_bf16_and_dynamic_m():
    kw = make_inputs(3, torch.bfloat16, seed=1)
    gm, named = capture(form_unrolled, kw, dynamic_m=True)
    for site in final_norm_site(gm, named["g"]):
        _check_site(site, named, 3)


def test_unrolled_key_norms_are_not_residual_sites():
    """The unrolled mixer normalises each source on its own, `updated` among them: that key norm
    is no residual norm site (role "key_norm", updated None), so no pass fuses it as one."""
    kw = make_inputs(2)
    gm, named = capture(form_unrolled, kw)
    keys = [s for ss in rms_norms_by_input(gm.graph).values() for s in ss if s.weight is named["w_norm"]]
    assert keys
    res = [match_attnres_from_norm(s) for s in keys]
    assert all(isinstance(r, AttnResSite) for r in res), res
    upd_keys = [r for r in res if r.role == "key_norm"]
    assert upd_keys and all(r.updated is None for r in upd_keys)
    # the blocks' key norms read a graph input, not a residual add: the plain form, as before
    assert all(r.role == "key_norm" or r.updated in (named["b0"], named["b1"]) for r in res)


def test_upcast_consumer_site_is_taken_at_the_model_dtype_output():
    """A consumer that reads the normed output as `.float()` (HF's router): the site found at the
    upcast names the bf16 output, so a rewrite there feeds every consumer."""
    def fn(prefix, delta, w_norm, w_qk, g, w_r, w_d, **kw):
        x = form_f_rms_norm(prefix, delta, w_norm, w_qk, g, **kw)
        return F.linear(x.float(), w_r.float()), F.linear(x, w_d)
    kw = make_inputs(2)
    kw["w_r"] = torch.randn(8, H).to(torch.bfloat16)
    kw["w_d"] = torch.randn(16, H).to(torch.bfloat16)
    gm, named = capture(fn, kw)
    sites = final_norm_site(gm, named["g"])
    assert len({s.norm.out for s in sites}) == 1
    for s in sites:
        _check_site(s, named, 2)


# ------------------------------------------------------------------------------------------ negatives
def wrong_softmax_over_hidden(prefix, delta, w_norm, w_qk, g, **kw):
    updated = prefix + delta
    srcs = torch.stack([*_blocks(kw), updated], 0)
    scores = _hand_rms(srcs) * w_norm.float() * w_qk.float()          # [S, M, H]
    p = torch.softmax(scores, -1)                                      # over the hidden dim
    return rms_norm((p * srcs.float()).sum(0).to(updated.dtype), g, EPS)


def wrong_no_w_qk(prefix, delta, w_norm, w_qk, g, **kw):
    updated = prefix + delta
    srcs = torch.stack([*_blocks(kw), updated], 0)
    logits = (_hand_rms(srcs) * w_norm.float()).sum(-1)
    p = torch.softmax(logits, 0)
    return rms_norm((p.unsqueeze(-1) * srcs.float()).sum(0).to(updated.dtype), g, EPS) + 0 * w_qk


def wrong_mean_logits(prefix, delta, w_norm, w_qk, g, **kw):
    """Unrolled, but the logits are a mean over the hidden dim (1/H of the spec's)."""
    updated = prefix + delta
    sources = [*_blocks(kw), updated]
    logits = torch.stack([(rms_norm(s, w_norm, EPS).float() * w_qk.float()).mean(-1) for s in sources])
    p = torch.softmax(logits, 0)
    return rms_norm(sum(p[i].unsqueeze(-1) * s.float() for i, s in enumerate(sources)).to(updated.dtype), g, EPS)


def wrong_unnormalised_keys(prefix, delta, w_norm, w_qk, g, **kw):
    """The keys are the raw sources (no RMSNorm in the logits): the mixed sum reads the sources only."""
    updated = prefix + delta
    sources = [*_blocks(kw), updated]
    srcs = torch.stack(sources)
    logits = (srcs.float() * w_norm.float() * w_qk.float()).sum(-1)
    p = torch.softmax(logits, 0)
    return rms_norm((p.unsqueeze(-1) * srcs.float()).sum(0).to(updated.dtype), g, EPS)


@pytest.mark.parametrize("fn, why", [
    (wrong_softmax_over_hidden, "differs from the spec formula"),
    (wrong_no_w_qk, "expected 2"),
    (wrong_mean_logits, "differs from the spec formula"),
])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_wrong_formulas_fail(fn, why, dt):
    kw = make_inputs(2, dt)
    gm, named = capture(fn, kw)
    for r in final_norm_site(gm, named["g"]):
        assert isinstance(r, Fail), r
        assert why in r.reason, r.reason


def test_unnormalised_keys_are_not_a_mixer_match():
    """No RMSNorm of the sources: no source is found by its role, and the norm is not a mixer site
    (the plain form: its input is the mixed sum, no residual add, so no pass takes it)."""
    kw = make_inputs(2)
    gm, named = capture(wrong_unnormalised_keys, kw)
    for r in final_norm_site(gm, named["g"]):
        assert isinstance(r, Fail) or (not r.blocks and not is_call(r.updated, aten.add.Tensor)), r


def test_plain_norm_of_a_projection_is_not_a_mixer():
    def fn(x, w, g):
        return rms_norm(F.linear(x, w), g, EPS)
    kw = {"x": torch.randn(M, 32).to(torch.bfloat16), "w": torch.randn(H, 32).to(torch.bfloat16),
          "g": torch.ones(H, dtype=torch.bfloat16)}
    gm, named = capture(fn, kw)
    for r in final_norm_site(gm, named["g"]):
        assert isinstance(r, AttnResSite) and not r.blocks and r.w_norm is None and r.role == "post_norm"
        assert is_call(r.updated, aten.mm.default), r.updated


# ------------------------------------------------------------------------------------------ vLLM's SM100 op
# `_C::kimi_k3_attn_res` as vLLM 0.33 calls it (vllm/_custom_ops.py kimi_k3_attn_res: prefix, delta, blocks,
# the weights and the output, then num_blocks, block_write_idx, eps, output_norm_eps; it writes prefix,
# blocks and output in place). Its CUDA library does not load here: a schema stub with a CPU implementation.
_ATTN_RES_SCHEMA = ("kimi_k3_attn_res(Tensor(a!) prefix, Tensor? delta, Tensor(b!) blocks, Tensor norm_weight, "
                    "Tensor qk_weight, Tensor? output_norm_weight, Tensor(c!) output, int num_blocks, "
                    "int block_write_idx, float eps, float output_norm_eps) -> ()")
_C_LIB = []


def _attn_res_cpu(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, output, num_blocks,
                  block_write_idx, eps, output_norm_eps):
    """vLLM's AttnRes kernel's math (fp32; the prefix-add rounded to the prefix dtype), in place."""
    upd = prefix.float() if delta is None else (prefix.float() + delta.float()).to(prefix.dtype).float()
    if delta is not None:
        prefix.copy_(upd)
    if block_write_idx >= 0:
        blocks[:, block_write_idx].copy_(upd)
    mixed = upd
    if num_blocks:
        values = torch.cat([blocks[:, :num_blocks].float(), upd[:, None]], 1)
        logits = (values * (norm_weight.float() * qk_weight.float())).sum(-1) * torch.rsqrt(values.pow(2).mean(-1) + eps)
        mixed = (torch.softmax(logits, -1)[..., None] * values).sum(1)
    if output_norm_weight is not None:
        mixed = mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + output_norm_eps) * output_norm_weight.float()
    output.copy_(mixed)


def _attn_res_op():
    if not hasattr(torch.ops._C, "kimi_k3_attn_res"):
        lib = torch.library.Library("_C", "FRAGMENT")
        lib.define(_ATTN_RES_SCHEMA)
        lib.impl("kimi_k3_attn_res", _attn_res_cpu, "CPU")
        lib.impl("kimi_k3_attn_res", lambda *a: None, "Meta")
        _C_LIB.append(lib)
    elif not _C_LIB:
        pytest.skip("vLLM's own _C::kimi_k3_attn_res is loaded (a CUDA op): this test stubs it on CPU")
    return torch.ops._C.kimi_k3_attn_res


@pytest.mark.parametrize("num_blocks, write", [(2, -1), (1, 1), (0, 0)])
def test_vllm_attn_res_op_becomes_the_mixer_the_patterns_parse(num_blocks, write):
    """vLLM's `_C::kimi_k3_attn_res` (a layer input's AttnRes: prefix += delta, optionally a block write,
    the mixer over the first num_blocks blocks, the output RMSNorm) reaches the K3 passes in
    auto_functionalized; the canonicalisation rewrites it into ATen ops that compute what it computes and
    that `match_attnres_from_norm` reads as the mixer over [blocks..., prefix + delta] with its two weights."""
    from k3compile.passes.canonicalize import canonicalize
    from k3compile.patterns.structure import op_name
    op = _attn_res_op()
    nb = 3

    def fn(prefix, delta, blocks, w_norm, w_qk, g):
        out = torch.empty_like(prefix)
        op(prefix, delta, blocks, w_norm, w_qk, g, out, num_blocks, write, EPS, EPS)
        return out, blocks.clone()

    kw = make_inputs(0, torch.float32)
    kw.pop("b0", None)
    kw = {"prefix": kw["prefix"], "delta": kw["delta"], "blocks": torch.randn(M, nb, H),
          "w_norm": kw["w_norm"], "w_qk": kw["w_qk"], "g": kw["g"]}
    gm, named = capture(fn, {k: v.clone() for k, v in kw.items()})
    assert any(op_name(n) == "_C::kimi_k3_attn_res" for n in gm.graph.nodes)
    phs = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    by_node = {named[k].target: v for k, v in kw.items() if k in named}
    want = gm(*[by_node[p].clone() for p in phs])   # the op's own (CPU) implementation
    assert canonicalize(gm.graph) >= 1
    assert not any(op_name(n) == "_C::kimi_k3_attn_res" for n in gm.graph.nodes)
    gm.graph.lint()
    gm.recompile()
    got = gm(*[by_node[p].clone() for p in phs])
    assert len(got) == len(want)
    for g, w in zip(got, want):   # the output, the blocks, and the new prefix (the input mutation)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    (site,) = final_norm_site(gm, named["g"])
    assert isinstance(site, AttnResSite), site
    assert is_call(site.updated, aten.add.Tensor) and set(site.updated.args) == {named["prefix"], named["delta"]}
    assert len(site.blocks) == num_blocks
    if num_blocks:
        assert {site.w_norm, site.w_qk} == {named["w_norm"], named["w_qk"]}
