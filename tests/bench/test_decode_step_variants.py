"""bench.decode_step's --variants: the settings an A/B call runs, and the environment each one runs in."""
from __future__ import annotations

import os

import pytest

from bench.decode_step import environment, parse_variants


def test_variants_parse_into_names_and_environments():
    assert parse_variants("") == [("base", {})]
    assert parse_variants("base; QERL_LORA_OVERLAP=0,QERL_PDL=1") == [
        ("base", {}), ("QERL_LORA_OVERLAP=0,QERL_PDL=1", {"QERL_LORA_OVERLAP": "0", "QERL_PDL": "1"})]
    for bad in ("QERL_PDL", "1X=2", "base;=3"):
        with pytest.raises(SystemExit, match="--variants"):
            parse_variants(bad)


def test_a_variant_sets_its_variables_for_the_block_and_restores_them(monkeypatch):
    monkeypatch.setenv("QERL_PDL", "1")
    monkeypatch.delenv("QERL_LORA_OVERLAP", raising=False)
    with environment({"QERL_PDL": "0", "QERL_LORA_OVERLAP": "0"}):
        assert os.environ["QERL_PDL"] == "0" and os.environ["QERL_LORA_OVERLAP"] == "0"
    assert os.environ["QERL_PDL"] == "1" and "QERL_LORA_OVERLAP" not in os.environ
