"""passes/pipeline.py: the one table of passes (order, needs, batch range, CUDA gate, evidence)."""
from __future__ import annotations

import pathlib
import re

import pytest

from k3compile.passes import pipeline
from k3compile.passes.base import K3Pass
from k3compile.passes.manager import PASSES

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_row_has_its_registered_pass_in_table_order():
    assert list(PASSES) == list(pipeline.PASS_ORDER)
    for name, p in PASSES.items():
        assert type(p) is pipeline.REGISTRY[name] and p.name == name
        assert p.needs == pipeline.ROWS[name].needs
        assert (ROOT / "k3compile" / "passes" / f"{name}.py").exists()


def test_every_row_cites_its_evidence():
    for r in pipeline.PIPELINE:
        lo, hi = r.cuda_m
        assert r.evidence, r.name
        if lo <= hi:   # the gate lets it run somewhere: a result file says why
            files = re.findall(r"bench/results/[\w{},.\-]+\.json", r.evidence)
            assert files, (r.name, r.evidence)
            for f in files:
                m = re.search(r"\{([^}]*)\}", f)
                for alt in (m.group(1).split(",") if m else [""]):
                    path = f[:m.start()] + alt + f[m.end():] if m else f
                    assert (ROOT / path).exists(), (r.name, path)
    for f in pipeline.FEATURES.values():
        assert f.part_of in pipeline.ROWS and pipeline.TP_ONLY in f.evidence


def test_a_pass_without_a_row_is_an_error():
    class Orphan(K3Pass):
        name = "not_in_the_table"
    with pytest.raises(ValueError, match="has no row in passes/pipeline.py"):
        pipeline.register(Orphan)
    assert "not_in_the_table" not in pipeline.REGISTRY


def test_a_row_without_a_pass_is_an_error(monkeypatch):
    monkeypatch.setattr(pipeline, "PASS_ORDER", (*pipeline.PASS_ORDER, "fold_nothing"))
    monkeypatch.setitem(pipeline.ROWS, "fold_nothing", pipeline.Row("fold_nothing"))
    with pytest.raises(ModuleNotFoundError):
        pipeline.passes()


def test_needs_name_earlier_passes():
    for r in pipeline.PIPELINE:
        for need in r.needs:
            assert pipeline.PASS_ORDER.index(need) < pipeline.PASS_ORDER.index(r.name)
