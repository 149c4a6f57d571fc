"""Hostile and careless configs: refused at parse time with one line, never run through a shell or outside results/."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qerl.config import load_config, parse_config
from qerl.errors import QerlError

REPO = Path(__file__).resolve().parents[1]


def repo_config() -> dict:
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def demo(raw: dict) -> dict:
    return raw["experiments"]["demo"]


def one_line_error(raw: dict) -> str:
    with pytest.raises(QerlError) as err:
        parse_config(raw)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("name", ["../x", "a/b", "my exp", ".hidden", "-rf", "x$(touch F)", "a;b", ""])
def test_unsafe_experiment_names_are_refused_at_parse_time(name):
    raw = repo_config()
    raw["experiments"][name] = raw["experiments"].pop("demo")
    raw.pop("ablations", None)  # they name the demo as their base
    raw["default_target"] = name
    assert "experiment name" in one_line_error(raw)


@pytest.mark.parametrize("name", ["qwen7b", "a.b", "x_1-2"])
def test_safe_experiment_names_parse(name):
    raw = repo_config()
    raw["experiments"][name] = raw["experiments"].pop("demo")
    raw.pop("ablations", None)  # they name the demo as their base
    raw["default_target"] = name
    assert name in parse_config(raw).experiments


def test_shell_syntax_as_a_model_name_is_refused():
    raw = repo_config()
    demo(raw)["model"] = "x$(touch F)"
    assert "experiments.demo.model" in one_line_error(raw)


@pytest.mark.parametrize("mutate, where", [
    (lambda e: e["eval"]["benchmarks"].append({"name": "gsm9k"}), "unknown benchmark 'gsm9k'"),
    (lambda e: e["train"].update(rewards=["corectness"], reward_weights=None), "corectness"),
    (lambda e: e["train"].update(rewards=["no_such_pkg_xyz.mod:fn"], reward_weights=None), "no_such_pkg_xyz"),
    (lambda e: e["train"].update(rewards=["os:sys tem"], reward_weights=None), "import path"),
    (lambda e: e["train"]["aqn"].update(sigma_start=1e-3, sigma_end=1e-2), "sigma_end"),
    (lambda e: e["train"].update(learning_rate=float("inf")), "learning_rate"),
    (lambda e: e["train"].update(max_grad_norm=float("nan")), "max_grad_norm"),
    (lambda e: e["train"].update(grading_timeout_s=0), "grading_timeout_s"),
    (lambda e: e.update(model_revision="v1"), "model_revision is for hub names"),
])
def test_late_failures_are_caught_at_parse_time(mutate, where):
    raw = repo_config()
    mutate(demo(raw))
    assert where in one_line_error(raw)


def test_custom_reward_import_path_of_an_installed_module_parses():
    raw = repo_config()
    demo(raw)["train"].update(rewards=["qerl.rewards:format_reward"], reward_weights=None)
    assert parse_config(raw).experiments["demo"].train.rewards == ["qerl.rewards:format_reward"]


def test_yaml_1_1_number_strings_read_the_same_in_check_and_snakemake(tmp_path):
    """PyYAML reads `1e-3` as a string: `qerl.config check` and the Snakefile give one verdict (accepted)."""
    text = (REPO / "config" / "config.yaml").read_text()
    assert "learning_rate: 1.0e-5" in text
    (tmp_path / "config").mkdir()
    cfg_file = tmp_path / "config" / "config.yaml"
    cfg_file.write_text(text.replace("learning_rate: 1.0e-5", "learning_rate: 1e-3")
                        .replace("tokenizer_dir: ../shared", f"tokenizer_dir: {REPO.parent}/shared"))
    assert yaml.safe_load(cfg_file.read_text())["_gsm8k_train"]["learning_rate"] == "1e-3"
    assert load_config(cfg_file).experiments["qwen7b"].train.learning_rate == 1e-3
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--snakefile",
                           str(REPO / "Snakefile"), "--directory", str(tmp_path), "results/qwen7b/eval.json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _write_config(work: Path, raw: dict) -> None:
    (work / "config").mkdir(exist_ok=True)
    (work / "config" / "config.yaml").write_text(yaml.safe_dump(raw))


def test_a_bad_config_stops_snakemake_with_one_line(tmp_path):
    raw = repo_config()
    raw["experiments"]["../x"] = copy.deepcopy(demo(raw))
    _write_config(tmp_path, raw)
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--snakefile",
                           str(REPO / "Snakefile"), "--directory", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and "experiment name '../x'" in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "x").exists() and not (tmp_path.parent / "x").exists()


def test_experiment_names_are_matched_literally_by_the_wildcard(tmp_path):
    """'a.b' must not also match results/aXb/... (an unescaped regex dot would)."""
    raw = repo_config()
    raw["experiments"] = {"a.b": demo(raw)}
    raw.pop("ablations", None)  # they name the demo as their base
    raw["default_target"] = "a.b"
    _write_config(tmp_path, raw)
    base = [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--snakefile", str(REPO / "Snakefile"),
            "--directory", str(tmp_path)]
    ok = subprocess.run(base + ["results/a.b/eval.json"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = subprocess.run(base + ["results/aXb/eval.json"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0


def test_shell_syntax_in_a_model_path_runs_nothing(tmp_path):
    """A local model path holding `$(...)` reaches the stage as one quoted word: the command never runs."""
    raw = repo_config()
    marker = tmp_path / "PWNED"  # the rules run in tmp_path, so an executed `touch PWNED` would create it
    model_dir = tmp_path / "m$(touch PWNED)"
    model_dir.mkdir()  # exists, so it is an input, but it is not a model: quantize fails with one line
    e = demo(raw)
    e["model"] = str(model_dir)
    raw["experiments"] = {"demo": e}
    _write_config(tmp_path, raw)
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--snakefile",
                           str(REPO / "Snakefile"), "--directory", str(tmp_path), "results/demo/quantized"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert not marker.exists(), "a $(...) in a config value was run by the shell"
    log = (tmp_path / "logs" / "demo" / "quantize.log").read_text()
    assert "config.json" in log or "model" in log, log[-2000:]
