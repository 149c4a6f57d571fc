"""The workflow's static contracts: the config parses, the schema is current, the paper experiment plans."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qerl.config import json_schema, load_config, parse_config, parse_section
from qerl.errors import QerlError

REPO = Path(__file__).resolve().parents[1]


def test_repo_config_is_valid_and_has_the_paper_settings():
    cfg = load_config(REPO / "config" / "config.yaml")
    assert cfg.default_target == "demo"
    t = cfg.experiments["qwen7b"].train
    assert cfg.experiments["qwen7b"].model == "Qwen/Qwen2.5-7B-Instruct"
    assert (t.lora.lora_r, t.learning_rate, t.num_generations, t.batch_size) == (32, 1e-5, 8, 128)
    assert (t.max_completion_length, t.epsilon, t.epsilon_high, t.beta) == (4096, 0.2, 0.28, 0.0)
    assert (t.aqn.sigma_start, t.aqn.sigma_end, t.aqn.num_stages) == (1e-2, 5e-4, 10)


def test_schema_file_is_generated_from_the_models():
    on_disk = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert on_disk == json_schema(), "run: python -m qerl.config schema > workflow/schemas/config.schema.yaml"


def test_schema_and_models_agree_on_the_repo_config():
    import jsonschema

    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    jsonschema.validate(raw, json_schema())
    bad = dict(raw, bogus=1)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, json_schema())
    with pytest.raises(QerlError, match="bogus: unknown key"):
        parse_config(bad)


@pytest.mark.parametrize("section, data, key", [
    ("train", {"data": {"source": "x"}, "epsilon": 0.3, "epsilon_high": 0.2}, "epsilon_high"),
    ("train", {"data": {"source": "x"}, "num_generations": 1}, "num_generations"),
    ("train", {"data": {}}, "data.source"),
    ("eval", {"benchmarks": [{"name": "gsm8k", "k": 0}]}, "benchmarks.0.k"),
    ("quantize", {"scheme": "int3"}, "scheme"),
])
def test_section_errors_name_the_key(section, data, key):
    with pytest.raises(QerlError) as err:
        parse_section(section, data)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_qerl_mode_needs_an_fp4_scheme():
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    raw["experiments"]["qwen7b"]["quantize"] = {"scheme": "bf16"}
    with pytest.raises(QerlError, match="qlora_fp4 needs quantize.scheme"):
        parse_config(raw)


def test_paper_experiment_plans_all_four_stages_without_weights():
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "results/qwen7b/eval.json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("rule ")]
    assert sorted(j.rstrip(":") for j in jobs) == ["evaluate", "merge", "quantize", "train"]
