"""Hostile config input, second round (qerl.config_input): YAML alias bombs, duplicate keys and syntax errors, paths
that leave what the user named, revisions that are not refs, empty stop strings. Each is one line naming the file
or key before any work."""
from __future__ import annotations

import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from qerl.config import load_config, parse_config
from qerl.errors import QerlError
from qerl.paths import Layout

REPO = Path(__file__).resolve().parents[1]
CONFIG_TEXT = (REPO / "config" / "config.yaml").read_text()
# ten levels of ten aliases: 10**10 strings once expanded, 100 nodes as written
BOMB = "\n".join(["_l0: &l0 lol"] + [f"_l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 11)]
                 + ["_anything: *l10", ""])


def _refused(fn, *args) -> str:
    with pytest.raises(QerlError) as err:
        fn(*args)
    assert "\n" not in str(err.value)
    return str(err.value)


def _config_file(tmp_path: Path, text: str) -> Path:
    (tmp_path / "config").mkdir(exist_ok=True)
    file = tmp_path / "config" / "config.yaml"
    file.write_text(text.replace("tokenizer_dir: ../shared", f"tokenizer_dir: {REPO.parent}/shared"))
    return file


def _parse_error(mutate) -> str:
    raw = yaml.safe_load(CONFIG_TEXT)
    mutate(raw)
    return _refused(parse_config, raw)


# ------------------------------------------------------------------------------------------ YAML
def test_the_repo_config_reads_as_safe_load_does():
    """Anchors, aliases and `<<:` overrides (which are not duplicates) read as before."""
    assert load_config(REPO / "config" / "config.yaml").experiments
    from qerl.config_input import load_yaml_file

    assert load_yaml_file(REPO / "config" / "config.yaml") == yaml.safe_load(CONFIG_TEXT)


def test_an_alias_bomb_is_refused_quickly_without_expanding_it(tmp_path):
    file = _config_file(tmp_path, CONFIG_TEXT + BOMB)
    start = time.perf_counter()
    line = _refused(load_config, file)
    assert time.perf_counter() - start < 5
    assert line.startswith(f"{file}:") and "alias *l" in line and "YAML alias bomb" in line, line
    proc = subprocess.run([sys.executable, "-m", "qerl.config", "check", str(file)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [f"error: {line}"], proc.stderr[-2000:]


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path):
    file = _config_file(tmp_path, CONFIG_TEXT + "_loop: &loop [1, *loop]\n")
    assert "_loop.1: alias *loop inside its own anchor" in _refused(load_config, file)


def test_a_duplicate_key_is_refused_with_its_key_and_lines(tmp_path):
    text = CONFIG_TEXT.replace("  learning_rate: 1.0e-5 ", "  learning_rate: 1.0e-5\n  learning_rate: 3.0e-4 ", 1)
    file = _config_file(tmp_path, text)
    first = text.splitlines().index(next(ln for ln in text.splitlines() if ln.startswith("  learning_rate:"))) + 1
    line = _refused(load_config, file)
    assert line.startswith(f"{file}:{first + 1}:3: _gsm8k_train.learning_rate: duplicate key 'learning_rate' "
                           f"(first at line {first})"), line


def test_a_yaml_syntax_error_names_line_and_column(tmp_path):
    file = _config_file(tmp_path, CONFIG_TEXT + "broken: [1, 2\nnext: 3\n")
    line = _refused(load_config, file)
    n = len(CONFIG_TEXT.splitlines()) + 2
    assert line.startswith(f"{file}:{n}:") and "not valid YAML" in line, line


def test_a_config_that_is_not_a_mapping_is_one_line(tmp_path):
    assert "expected a mapping" in _refused(load_config, _config_file(tmp_path, "- a\n- b\n"))


def _snakemake(work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--snakefile",
                           str(REPO / "Snakefile"), "--directory", str(work), *args],
                          capture_output=True, text=True, timeout=150)


def test_snakemake_refuses_a_bomb_before_its_own_loader(tmp_path):
    """Snakemake's configfile loader (and something after it) would walk the bomb for minutes: the Snakefile reads
    the config and every --configfile through qerl's reader first."""
    _config_file(tmp_path, CONFIG_TEXT + BOMB)
    proc = _snakemake(tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "YAML alias bomb" in errors[0], proc.stderr[-2000:]
    _config_file(tmp_path, CONFIG_TEXT)
    extra = tmp_path / "more.yaml"
    extra.write_text("results_dir: out\nresults_dir: elsewhere\n")
    proc = _snakemake(tmp_path, "--configfile", str(extra))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and "duplicate key 'results_dir' (first at line 1)" in errors[0], proc.stderr[-2000:]


# ------------------------------------------------------------------------------------------ paths
@pytest.mark.parametrize("results_dir", ["/", "/tmp", "//", "/etc/qerl", "/usr/local/results", "../results",
                                         "results/../../x", ".", "./", "~/results", ""])
def test_results_dir_outside_what_the_user_named_is_refused(results_dir):
    line = _parse_error(lambda raw: raw.update(results_dir=results_dir))
    assert line.startswith("config: results_dir: "), line


def test_results_dir_may_not_be_the_working_directory_or_above(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for above in (tmp_path, tmp_path.parent):
        assert "working directory" in _parse_error(lambda raw: raw.update(results_dir=str(above)))


@pytest.mark.parametrize("results_dir", ["results", "out/results", "results.v2", "/scratch/me/qerl"])
def test_sane_results_dirs_parse(results_dir):
    raw = yaml.safe_load(CONFIG_TEXT)
    raw["results_dir"] = results_dir
    assert parse_config(raw).results_dir == results_dir


@pytest.mark.parametrize("method", ["../../etc", "a/b", "", ".x", "a b"])
def test_ablation_method_names_cannot_leave_results(method):
    def plant(raw):
        raw["ablations"]["demo_ablation"]["methods"][method] = {"label": "x"}

    assert _parse_error(plant).startswith(f"config: ablations.demo_ablation.methods.{method}: "), method


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", "a\\b", ""])
def test_the_layout_refuses_names_that_are_not_one_folder(name):
    layout = Layout("results")
    for where in (layout.eval_json, layout.quantized, layout.bench_json, layout.ablation):
        assert "cannot be a folder name" in _refused(where, name)


# ------------------------------------------------------------------------------------------ revisions, stop strings
@pytest.mark.parametrize("revision", ["../../x", "main/../../x", "/abs", "a\\b", "a\0b", "a b", ".hidden", "v1.lock",
                                      "main/", "@", "a@{1}", "x" * 256])
def test_model_revision_is_a_ref_name(revision):
    line = _parse_error(lambda raw: raw["experiments"]["qwen7b"].update(model_revision=revision))
    assert line.startswith("config: experiments.qwen7b.model_revision: ") and "branch, tag or commit" in line, line


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", "release/2024-06", "0123456789abcdef" * 2 + "0" * 8])
def test_ref_names_parse(revision):
    raw = yaml.safe_load(CONFIG_TEXT)
    raw["experiments"]["qwen7b"]["model_revision"] = revision
    assert parse_config(raw).experiments["qwen7b"].model_revision == revision


@pytest.mark.parametrize("section, stop, key", [
    ("eval", [""], "experiments.demo.eval.stop.0"),
    ("rollout", ["\n", ""], "experiments.demo.train.rollout.stop.1"),
])
def test_an_empty_stop_string_is_refused(section, stop, key):
    def plant(raw):
        demo = copy.deepcopy(raw["experiments"]["demo"])
        (demo["eval"] if section == "eval" else demo["train"].setdefault("rollout", {}))["stop"] = stop
        raw["experiments"]["demo"] = demo

    line = _parse_error(plant)
    assert line.startswith(f"config: {key}: ''") and "empty stop string" in line, line
