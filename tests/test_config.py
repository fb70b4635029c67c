"""k3compile/config.py: the one reader of the environment; ten user switches; the experiment knobs."""
from __future__ import annotations

import pathlib
import re

import pytest

from k3compile import config
from k3compile.config import knobs_text

ROOT = pathlib.Path(__file__).resolve().parent.parent / "k3compile"


def test_only_config_reads_the_environment():
    readers = []
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT).as_posix()
        if rel == "config.py" or rel.startswith("integrations/"):   # the vLLM plugin reads K3_VLLM itself
            continue
        for line in p.read_text().splitlines():
            if re.search(r"os\.environ(?!\.(setdefault|update))|os\.getenv", line):
                readers.append(f"{rel}: {line.strip()}")
    assert not readers, readers


def test_at_most_fifteen_names_and_ten_documented_switches():
    names = set()
    for p in ROOT.rglob("*.py"):
        names |= set(re.findall(r"\bK3_[A-Z0-9_]+", p.read_text()))
    assert len(names) <= 15, sorted(names)
    assert len(config.SWITCHES) <= 10 and all(config.SWITCHES.values())
    assert names <= set(config.SWITCHES) | {config.KNOBS_VAR, "K3_VLLM"}, sorted(names)


def test_knobs_parse_continue_and_refuse_unknown_names(monkeypatch):
    monkeypatch.setenv("K3_KNOBS", "attention_ops=my::a,my::b,gemv_cfg=64x32=gemv 8/64/4/2;32x32=cublas,cute=0")
    k = config.knobs()
    assert k.attention_ops == "my::a,my::b" and k.gemv_cfg == "64x32=gemv 8/64/4/2;32x32=cublas" and k.cute == "0"
    assert config.knob("cute") == "0" and config.knob("mxfp4", "v3") == "v3"
    assert config.knob_flag("cute", True) is False and config.knob_flag("comm_vec", True) is True
    assert knobs_text(cute="", mxfp4="v3").endswith("mxfp4=v3") and "cute=" not in knobs_text(cute="")
    monkeypatch.setenv("K3_KNOBS", "no_such_knob=1")
    with pytest.raises(ValueError, match="unknown k3 knob 'no_such_knob'"):
        config.knobs()
    with pytest.raises(KeyError, match="not a k3compile switch"):
        config.env("K3_NOT_A_SWITCH")


def test_every_knob_is_in_the_pass_managers_cache_key(monkeypatch):
    from k3compile.passes.manager import PassManager
    monkeypatch.delenv("K3_KNOBS", raising=False)
    base = PassManager().uuid()
    for name in config.KNOB_NAMES:
        monkeypatch.setenv("K3_KNOBS", f"{name}=7")
        assert PassManager().uuid() != base, name
    monkeypatch.delenv("K3_KNOBS")
    assert PassManager().uuid() == base
