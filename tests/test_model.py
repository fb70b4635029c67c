"""Tests for the K3 reference model (k3compile.model): TP equivalence, prefill/decode
consistency, the SiTU / AttnRes / RMSNorm math, input validation, real-size shapes on the
meta device, and deterministic weights.

Tolerances: the numerical tests build float32 models (the presets are bfloat16); logits are compared
with atol = 1e-4 * max|logits| (rtol 0).
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))  # for `_ranks` (also what spawned ranks import)

import _ranks  # noqa: E402

from k3compile.distributed import run_ranks  # noqa: E402
from k3compile.model import K3Cache, K3Config, K3Model, TPInfo  # noqa: E402
from k3compile.model.functional import attnres_mix, rms_norm, situ  # noqa: E402

LOGIT_RTOL_OF_SCALE = 1e-4  # atol = this * max|reference logits|


def _ids(shape, vocab, seed):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _assert_logits_close(got, ref, what):
    got, ref = torch.as_tensor(got), torch.as_tensor(ref)
    atol = LOGIT_RTOL_OF_SCALE * float(ref.abs().max())
    err = float((got - ref).abs().max())
    assert err <= atol, f"{what}: max |diff| {err:.3g} > atol {atol:.3g}"


# --------------------------------------------------------------------------- 1. TP=2 == TP=1
def test_tp2_matches_tp1_prefill_and_decode():
    """One gloo run with 2 ranks: prefill 3 tokens then 3 decode steps, batch 2, on tiny().
    Logits of both ranks equal TP=1 within atol = 1e-4 * max|logits|; the replicated MLA latent
    KV cache equals TP=1's; each rank's KDA state is its head-slice of TP=1's state. The same
    run checks that a TP=1 cache is refused by the TP=2 model and that TPInfo.current refuses a
    TP size other than the world size."""
    cfg = K3Config.tiny(dtype="float32")
    assert cfg.kda_layers and cfg.mla_layers, "tiny() must have both KDA and MLA layers"
    assert any(cfg.writes_block(i) for i in range(cfg.num_layers)), "tiny() must write AttnRes blocks"
    assert any(cfg.blocks_before(i) > 0 for i in range(cfg.num_layers)), "blocks must be read by later layers"
    assert cfg.dense_layers and cfg.moe_layers
    M, T, S = 2, 3, 3
    prompt = _ids((M, T), cfg.vocab, 1)
    steps = _ids((S, M), cfg.vocab, 2)

    world = 2
    out = run_ranks(_ranks.tp_decode, world, cfg, prompt, steps, backend="gloo", timeout=300)

    ref_model = K3Model(cfg)
    cache = ref_model.new_cache(M)
    ref = [ref_model.prefill(prompt, cache)] + [ref_model.decode(t, cache) for t in steps]

    for r, o in enumerate(out):
        assert len(o["logits"]) == len(ref)
        for step, (got, want) in enumerate(zip(o["logits"], ref)):
            _assert_logits_close(got, want, f"rank {r} step {step}")
        assert o["seq_lens"].tolist() == [T + S] * M
        for i in cfg.mla_layers:
            torch.testing.assert_close(torch.as_tensor(o["kv"][i]), cache.kv[i], atol=1e-5, rtol=1e-4)
        Hr = cfg.kda_heads // world
        for i in cfg.kda_layers:
            want = cache.state[i][:, r * Hr:(r + 1) * Hr]
            torch.testing.assert_close(torch.as_tensor(o["state"][i]), want, atol=1e-5, rtol=1e-4)
        assert "cache was made for TP=1" in o["err_cache_tp"] and "TP=2" in o["err_cache_tp"], o["err_cache_tp"]
        assert o["err_tp_world"].startswith("ValueError") and "world size 2" in o["err_tp_world"], o["err_tp_world"]
    # the ranks agree exactly on the (all-reduced) logits
    for a, b in zip(out[0]["logits"], out[1]["logits"]):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=0, rtol=0)


# --------------------------------------------------------------------------- 2. prefill == decode
def test_prefill_then_decode_equals_decode_from_scratch():
    """Prefill T=3 tokens then decode 1 vs decoding the same 4 tokens one at a time:
    logits (after the prefill and after the last token) and every cache entry match."""
    cfg = K3Config.tiny(dtype="float32")
    model = K3Model(cfg)
    M, T = 2, 3
    toks = _ids((M, T + 1), cfg.vocab, 3)

    c_pre = model.new_cache(M)
    l_prefill = model.prefill(toks[:, :T], c_pre)
    l_pre = model.decode(toks[:, T], c_pre)

    c_dec = model.new_cache(M)
    l_dec = [model.decode(toks[:, t], c_dec) for t in range(T + 1)]

    assert l_pre.shape == (M, cfg.vocab) and l_pre.dtype == torch.float32
    _assert_logits_close(l_prefill, l_dec[T - 1], "prefill last-token logits")
    _assert_logits_close(l_pre, l_dec[T], "decode after prefill")
    assert c_pre.seq_lens.tolist() == c_dec.seq_lens.tolist() == [T + 1] * M
    for i in cfg.kda_layers:
        torch.testing.assert_close(c_pre.state[i], c_dec.state[i], atol=1e-5, rtol=1e-4, msg=f"kda state {i}")
        torch.testing.assert_close(c_pre.conv[i], c_dec.conv[i], atol=1e-5, rtol=1e-4, msg=f"kda conv {i}")
    for i in cfg.mla_layers:
        torch.testing.assert_close(c_pre.kv[i], c_dec.kv[i], atol=1e-5, rtol=1e-4, msg=f"mla kv {i}")
        assert c_pre.kv[i][:, T + 1:].abs().max() == 0  # nothing written past the cached tokens
        assert c_pre.kv[i][:, :T + 1].abs().amax(-1).min() > 0  # every cached position written
    # the conv state holds the last kda_conv-1 inputs: not all zero after 4 tokens
    assert all(c_pre.conv[i].abs().max() > 0 for i in cfg.kda_layers)


# --------------------------------------------------------------------------- 3. hand-computed math
def test_situ_hand_computed():
    # gate_up = [gate | up], gate = [0, 1, 100, -100], up = [2, 3, 1000, 5]
    x = torch.tensor([[0.0, 1.0, 100.0, -100.0, 2.0, 3.0, 1000.0, 5.0]])
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    want = [
        0.0,  # gate 0: 4 * tanh(0) * sigmoid(0) = 0
        4 * math.tanh(1 / 4) * sig(1) * 25 * math.tanh(3 / 25),  # = 0.71620 * 2.98568 ~ 2.13834
        4.0 * 25.0,  # gate 100 -> 4*tanh(25)*1 ~ 4; up 1000 -> 25*tanh(40) ~ 25: saturates at 100
        0.0,  # gate -100: sigmoid(-100) ~ 3.7e-44 -> 0
    ]
    got = situ(x)
    assert got.shape == (1, 4)
    torch.testing.assert_close(got, torch.tensor([want]), atol=1e-6, rtol=1e-6)
    assert abs(want[1] - 2.13834) < 1e-5
    # other betas: beta=1, lb=1 on gate=1, up=1: tanh(1)*sigmoid(1)*tanh(1) = 0.7616*0.7311*0.7616
    got = situ(torch.tensor([1.0, 1.0]), beta=1.0, linear_beta=1.0)
    torch.testing.assert_close(got, torch.tensor([math.tanh(1) ** 2 * sig(1)]))
    # fp32 math, returned in the input dtype
    assert situ(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_rms_norm_hand_computed():
    # [3, 4]: mean square 12.5, rms 3.5355 -> [0.8485, 1.1314]; weight [2, 0.5] -> [1.6971, 0.5657]
    x = torch.tensor([[3.0, 4.0]])
    r = math.sqrt(12.5)
    torch.testing.assert_close(rms_norm(x, None, 0.0), torch.tensor([[3 / r, 4 / r]]))
    torch.testing.assert_close(rms_norm(x, torch.tensor([2.0, 0.5]), 0.0), torch.tensor([[6 / r, 2 / r]]))
    # eps enters under the root: [1, 1] with eps 1 -> 1/sqrt(2)
    torch.testing.assert_close(rms_norm(torch.ones(1, 2), None, 1.0), torch.full((1, 2), 2 ** -0.5))
    assert rms_norm(x.to(torch.bfloat16), None, 1e-5).dtype == torch.bfloat16


def test_attnres_hand_computed():
    eps = 0.0
    prefix, delta = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 2.0]])
    ones = torch.ones(2)
    g = torch.tensor([2.0, 3.0])
    # no blocks: updated = prefix + delta = [4, 4]; out = rmsnorm([4, 4]) * g = [1, 1] * g = [2, 3]
    out, upd = attnres_mix(prefix, delta, [], ones, ones, g, eps)
    torch.testing.assert_close(upd, torch.tensor([[4.0, 4.0]]))
    torch.testing.assert_close(out, torch.tensor([[2.0, 3.0]]))
    # delta None: updated is prefix itself; out = rmsnorm([1, 2]) = [1, 2] / sqrt(2.5)
    out, upd = attnres_mix(prefix, None, [], ones, ones, ones, eps)
    assert upd is prefix
    torch.testing.assert_close(out, prefix / math.sqrt(2.5))
    # one block b = [2, 0]; w_norm * w_qk = [1, 1] * [1, 0] = [1, 0] so logit = rmsnorm(src)[0]:
    #   rmsnorm(b) = [2, 0] / sqrt(2) -> logit sqrt(2); rmsnorm([4, 4]) = [1, 1] -> logit 1
    #   p = softmax([sqrt2, 1]); mixed = p0 * [2, 0] + p1 * [4, 4]; out = rmsnorm(mixed) (g = 1)
    b = torch.tensor([[2.0, 0.0]])
    e0, e1 = math.exp(math.sqrt(2)), math.exp(1.0)
    p0, p1 = e0 / (e0 + e1), e1 / (e0 + e1)  # 0.60210, 0.39790
    mixed = [2 * p0 + 4 * p1, 4 * p1]  # [2.79580, 1.59161]
    rms = math.sqrt((mixed[0] ** 2 + mixed[1] ** 2) / 2)
    out, upd = attnres_mix(prefix, delta, [b], ones, torch.tensor([1.0, 0.0]), ones, eps)
    torch.testing.assert_close(upd, torch.tensor([[4.0, 4.0]]))
    torch.testing.assert_close(out, torch.tensor([[mixed[0] / rms, mixed[1] / rms]]))
    assert abs(p0 - 0.60210) < 1e-5
    # w_qk = 0: equal logits -> plain mean of the sources [[2, 0], [4, 4]] = [3, 2]
    out, _ = attnres_mix(prefix, delta, [b], ones, torch.zeros(2), ones, eps)
    torch.testing.assert_close(out, torch.tensor([[3.0, 2.0]]) / math.sqrt(6.5))


# --------------------------------------------------------------------------- 4. bad input
@pytest.fixture(scope="module")
def tiny_model():
    return K3Model(K3Config.tiny())


def test_bad_token_dtype(tiny_model):
    m = tiny_model
    with pytest.raises(TypeError, match=r"token_ids must be int64 or int32, got torch.float32"):
        m.decode(torch.zeros(2), m.new_cache(2))
    with pytest.raises(TypeError, match=r"token_ids must be int64 or int32, got torch.float32"):
        m.prefill(torch.zeros(2, 3), m.new_cache(2))
    with pytest.raises(TypeError, match=r"token_ids must be int64 or int32"):
        m(torch.zeros(2, 1), m.new_cache(2))


def test_bad_token_shape(tiny_model):
    m = tiny_model
    with pytest.raises(ValueError, match=r"token_ids must be \[M, T\], got shape \(2, 1, 1\)"):
        m(torch.zeros(2, 1, 1, dtype=torch.long), m.new_cache(2))
    with pytest.raises(ValueError, match=r"prefill takes token_ids of shape \[M, T\], got \(2, 1, 1\)"):
        m.prefill(torch.zeros(2, 1, 1, dtype=torch.long), m.new_cache(2))
    with pytest.raises(ValueError, match=r"decode takes token_ids of shape \[M\], got \(2, 1\)"):
        m.decode(torch.zeros(2, 1, dtype=torch.long), m.new_cache(2))


def test_out_of_range_ids(tiny_model):
    m = tiny_model
    V = m.cfg.vocab
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {V}\); got min -1"):
        m.decode(torch.tensor([-1, 0]), m.new_cache(2))
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {V}\); got min 0, max {V}"):
        m.decode(torch.tensor([V, 0]), m.new_cache(2))
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {V}\)"):
        m.prefill(torch.tensor([[0, 1], [2, V + 5]]), m.new_cache(2))


def test_cache_from_other_config(tiny_model):
    m = tiny_model
    tok = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"cache was made for config 'small', the model has config 'tiny'"):
        m.decode(tok, K3Cache(K3Config.small(), 2))
    # same name, different field (seed): still refused
    with pytest.raises(ValueError, match=r"cache was made for config 'tiny'.*variant"):
        m.decode(tok, K3Cache(K3Config.tiny(seed=1), 2))


def test_cache_other_batch(tiny_model):
    m = tiny_model
    with pytest.raises(ValueError, match=r"cache holds 3 sequences, token_ids has batch 2"):
        m.decode(torch.tensor([1, 2]), m.new_cache(3))
    with pytest.raises(ValueError, match=r"cache batch must be >= 1, got 0"):
        m.new_cache(0)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_cache_other_batch_compiled(tiny_model, fullgraph):
    """The compiled forward checks the cache's batch as eager does (the check reads shapes only, so it is
    traced): the same ValueError, not a fake-tensor shape error from deep inside a layer. With
    fullgraph=True dynamo cannot leave the graph to raise: its error carries the ValueError."""
    m = tiny_model
    f = torch.compile(m, backend="eager", fullgraph=fullgraph)
    ids = torch.tensor([[1], [2]])
    f(ids, m.new_cache(2))   # a matching cache first: the mismatch is a recompile, as in a real loop
    want = "cache holds 3 sequences, token_ids has batch 2"
    if fullgraph:
        with pytest.raises(Exception, match=rf"ValueError\('{want}'\)"):
            f(ids, m.new_cache(3))
    else:
        with pytest.raises(ValueError, match=rf"^{want}$"):
            f(ids, m.new_cache(3))
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=rf"^{want}$"):   # and on the first call
        torch.compile(m, backend="eager")(ids, m.new_cache(3))
    if not fullgraph:   # the TP check is traced too
        with pytest.raises(ValueError, match=r"^cache was made for TP=2, the model runs TP=1$"):
            f(ids, K3Cache(m.cfg, 2, TPInfo(rank=0, size=2, group_name="x")))


def test_presets_default_to_bfloat16():
    """The fused ops take bfloat16 by default (K3Options.dtypes): the built-in configs match it."""
    from k3compile.options import K3Options
    for cfg in (K3Config.tiny(), K3Config.small(), K3Config.kimi_k3()):
        assert cfg.dtype == "bfloat16" and cfg.dtype in K3Options.make().dtypes, cfg.name
    assert K3Model(K3Config.tiny(num_layers=1)).embed.dtype == torch.bfloat16
    assert K3Config.tiny(dtype="float32").torch_dtype == torch.float32


def test_cache_other_tp(tiny_model):
    m = tiny_model
    cache = K3Cache(m.cfg, 2, TPInfo(rank=0, size=2, group_name="x"))
    with pytest.raises(ValueError, match=r"cache was made for TP=2, the model runs TP=1"):
        m.decode(torch.tensor([1, 2]), cache)


def test_cache_full(tiny_model):
    m = tiny_model
    cache = m.new_cache(2, max_seq=2)
    with pytest.raises(ValueError, match=r"cache is full: 3 new tokens but room for 2 \(max_seq=2\)"):
        m.prefill(torch.zeros(2, 3, dtype=torch.long), cache)
    assert cache.seq_lens.tolist() == [0, 0]  # the refused call changed nothing
    m.prefill(torch.zeros(2, 2, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"cache is full: 1 new tokens but room for 0 \(max_seq=2\)"):
        m.decode(torch.zeros(2, dtype=torch.long), cache)
    # forward (the traced path) is caught by the MLA op's own overflow check
    with pytest.raises(ValueError, match=r"kv_cache is full"):
        m(torch.zeros(2, 1, dtype=torch.long), cache)


def test_bad_tp_size():
    cfg = K3Config.tiny()  # kda/mla heads 4, hidden 64, expert_inter 64
    with pytest.raises(ValueError, match=r"TP size 3 does not divide kda_heads=4, mla_heads=4"):
        cfg.check_tp(3)
    with pytest.raises(ValueError, match=r"TP size 3 does not divide .*expert_inter=64"):
        K3Model(cfg, TPInfo(rank=0, size=3, group_name="x"))
    with pytest.raises(ValueError, match=r"TP size must be >= 1, got 0"):
        cfg.check_tp(0)
    # divides every dim but leaves 64/4 = 16 expert columns per rank: not a whole MXFP4 block
    with pytest.raises(ValueError, match=r"TP size 4: per-rank expert intermediate 16 .*MXFP4 block \(32\)"):
        K3Model(cfg, TPInfo(rank=0, size=4, group_name="x"))
    with pytest.raises(ValueError, match=r"TP size 2 requested but torch.distributed is not initialised"):
        TPInfo.current(2)
    cfg.check_tp(2)  # fine
    K3Config.kimi_k3().check_tp(8)  # fine


# --------------------------------------------------------------------------- 5. real size, meta
MB = 1e6


def _nbytes(t):
    return t.numel() * t.element_size()


def test_kimi_k3_meta_shapes_tp8():
    assert not (dist.is_available() and dist.is_initialized())  # TPInfo built by hand, no group
    cfg = K3Config.kimi_k3()
    tp = TPInfo(rank=0, size=8, group_name="x")
    model = K3Model(cfg, tp, meta=True, layers=[0, 1, 3])
    assert list(model.layers) == ["0", "1", "3"]
    l0, l1, l3 = (model.layers[k] for k in ("0", "1", "3"))
    assert (l0.is_dense, l0.is_mla, l1.is_dense, l1.is_mla, l3.is_dense, l3.is_mla) == (
        True, False, False, False, False, True)
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    bf16 = torch.bfloat16

    def shape(t, s, dtype=bf16):
        assert tuple(t.shape) == s and t.dtype == dtype, (tuple(t.shape), t.dtype, s, dtype)

    # KDA (layer 1): 96 heads / 8 = 12 per rank, head dim 128
    kda = l1.attn
    shape(kda.in_proj, (4 * 1536 + 12 + 128, 7168))
    shape(kda.f_b, (1536, 128))
    shape(kda.o_proj, (7168, 1536))
    # MLA (layer 3)
    mla = l3.attn
    shape(mla.qkv_a, (1536 + 576 + 1536, 7168))
    shape(mla.q_b, (12 * 192, 1536))
    shape(mla.o_proj, (7168, 1536))
    # LatentMoE (layer 1): router / latent_down replicated, latent_up split by output rows
    moe = l1.mlp
    shape(moe.router, (896, 7168))
    shape(moe.latent_down, (3584, 7168))
    shape(moe.latent_up, (896, 3584))
    shape(moe.w13, (896, 768, 3584 // 2), torch.uint8)  # [gate|up] 2 x 3072/8, 2 FP4 per byte
    shape(moe.w13_scale, (896, 768, 3584 // 32), torch.uint8)
    shape(moe.w2, (896, 3584, 384 // 2), torch.uint8)
    shape(moe.w2_scale, (896, 3584, 384 // 32), torch.uint8)
    shape(moe.shared.gate_up, (2 * 6144 // 8, 7168))
    shape(moe.shared.down, (7168, 768))
    # dense MLP (layer 0)
    shape(l0.mlp.gate_up, (2 * 33792 // 8, 7168))
    shape(l0.mlp.down, (7168, 33792 // 8))
    assert isinstance(l0.attn, type(kda))
    shape(model.embed, (163840, 7168))
    shape(model.lm_head, (163840, 7168))

    # per-rank bytes at batch 1 (spec section 2 table)
    per_expert = sum(_nbytes(t[0]) for t in (moe.w13, moe.w13_scale, moe.w2, moe.w2_scale))
    table = {
        "kda in_proj": (_nbytes(kda.in_proj), 90),
        "o_proj": (_nbytes(kda.o_proj), 22),
        "router": (_nbytes(moe.router), 13),
        "latent down": (_nbytes(moe.latent_down), 51),
        "16 experts": (16 * per_expert, 35),
        "shared": (_nbytes(moe.shared.gate_up) + _nbytes(moe.shared.down), 33),
        "latent up": (_nbytes(moe.latent_up), 6),
    }
    for what, (got, want_mb) in table.items():
        assert abs(got / MB - want_mb) <= max(0.05 * want_mb, 0.5), f"{what}: {got / MB:.1f} MB vs ~{want_mb} MB"
    total = sum(v for v, _ in table.values()) / MB
    assert 240 <= total <= 260, total  # "about 250 MB"
    # replicated router + latent down are about a quarter of it
    assert 0.2 <= (table["router"][0] + table["latent down"][0]) / MB / total <= 0.3


# --------------------------------------------------------------------------- 6. determinism
def test_weights_deterministic_by_seed():
    a = K3Model(K3Config.tiny(seed=0)).state_dict()
    b = K3Model(K3Config.tiny(seed=0)).state_dict()
    c = K3Model(K3Config.tiny(seed=1)).state_dict()
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs between two builds with the same seed"
    differ = [k for k in a if not torch.equal(a[k], c[k])]
    assert len(differ) == len(a), f"same under seeds 0 and 1: {sorted(set(a) - set(differ))}"
