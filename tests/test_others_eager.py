"""Eager checks of the three independent Kimi K3 implementations in tests/others/.

Each style (hf_style, functional, fused) was written from the spec alone. Checked here:
  * logits finite, shape [M, vocab] for every decode step, at world 1 and world 2 (gloo);
  * world 2 == world 1 per style (bf16 tolerance; and tight in fp32), which validates the TP sharding;
  * the three styles agree with each other from the same full weights (bf16 tolerance; tight in fp32);
  * each style's MXFP4 decoding agrees with a dequantisation written here from the spec.
No compiler backend is used here.
"""
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.others import functional, fused, hf_style  # noqa: E402
from tests.others import run as R  # noqa: E402
from tests.others import weights as K3W  # noqa: E402

MS = (1, 3)
STEPS = 2
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _err(out, ref):
    return (out - ref).abs().max().item()


def _assert_bf16_close(out, ref, what):
    tol = 2e-2 * ref.abs().max().item() + 1e-2
    assert _err(out, ref) <= tol, f"{what}: max abs err {_err(out, ref):.4g} > {tol:.4g}"


def _assert_fp32_close(out, ref, what):
    tol = 1e-4 * ref.abs().max().item() + 1e-5
    assert _err(out, ref) <= tol, f"{what}: max abs err {_err(out, ref):.4g} > {tol:.4g}"


@pytest.fixture(scope="module")
def world1():
    return {(s, M, d): R.run(s, 1, 0, M, steps=STEPS, dtype=dt, all_steps=True)[0]
            for s in R.STYLES for M in MS for d, dt in DTYPES.items()}


@pytest.fixture(scope="module")
def world2():
    keys = [(s, M, d) for s in R.STYLES for M in MS for d in DTYPES]
    jobs = [dict(style=s, M=M, steps=STEPS, dtype=DTYPES[d], all_steps=True) for s, M, d in keys]
    return {k: eager for k, (eager, _) in zip(keys, R.launch_many(jobs, world=2))}


def _check_logits(out, M):
    cfg = K3W.tiny_config()
    assert out.shape == (STEPS, M, cfg.vocab_size)
    for s in range(STEPS):
        assert out[s].shape == (M, cfg.vocab_size)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert out.abs().max() > 0.1          # not a degenerate all-zero model


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("style", R.STYLES)
def test_world1_logits(world1, style, M):
    _check_logits(world1[(style, M, "bf16")], M)
    _check_logits(world1[(style, M, "fp32")], M)


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("style", R.STYLES)
def test_world2_matches_world1(world1, world2, style, M):
    _check_logits(world2[(style, M, "bf16")], M)
    _assert_bf16_close(world2[(style, M, "bf16")], world1[(style, M, "bf16")], f"{style} M={M} bf16 tp2 vs tp1")
    _assert_fp32_close(world2[(style, M, "fp32")], world1[(style, M, "fp32")], f"{style} M={M} fp32 tp2 vs tp1")


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("other", ("functional", "fused"))
def test_styles_agree(world1, world2, other, M):
    for results, w in ((world1, 1), (world2, 2)):
        ref = results[("hf_style", M, "bf16")]
        _assert_bf16_close(results[(other, M, "bf16")], ref, f"{other} vs hf_style M={M} tp{w} bf16")
        ref = results[("hf_style", M, "fp32")]
        _assert_fp32_close(results[(other, M, "fp32")], ref, f"{other} vs hf_style M={M} tp{w} fp32")


def test_mxfp4_decoding_matches_spec():
    """Pack known E2M1 codes (low nibble = even K index) and E8M0 scales; every style decodes them."""
    g = torch.Generator().manual_seed(1)
    E, N, K = 3, 5, 64
    idx = torch.randint(0, 16, (E, N, K), generator=g)
    scales = torch.randint(118, 132, (E, N, K // 32), generator=g).to(torch.uint8)
    packed = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)
    table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    expect = table[idx] * (2.0 ** (scales.float() - 127)).repeat_interleave(32, dim=-1)

    assert torch.equal(hf_style._mxfp4_to_float(packed, scales), expect)
    lut = torch.tensor(K3W.E2M1_VALUES, dtype=torch.float32)
    assert torch.equal(functional.mxfp4_dequant(packed, scales, lut), expect)
    # fused: the grouped GEMM against unit vectors returns the dequantised columns
    eye = torch.eye(K)
    for e in range(E):
        cols = fused.mxfp4_grouped_mm(eye, torch.full((K,), e, dtype=torch.int64), packed, scales)
        assert torch.equal(cols.t(), expect[e])


def test_attn_res_blocks_written():
    cfg = K3W.tiny_config()
    assert [i for i in range(cfg.num_hidden_layers) if cfg.writes_block(i)] == [0, 2]
    assert K3W.spec_layer_types(8) == ("kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla")
