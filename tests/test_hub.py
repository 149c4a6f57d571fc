"""Hub model names: resolved from a local HF cache in the hub's own layout (never the network), pinned by revision,
with one-line errors for everything that can go wrong."""
from __future__ import annotations

import json

import httpx
import pytest

from qerl.errors import QerlError
from qerl.hub import model_commit, resolve_model
from qerl.stage import run_main
from stage_errors import stage_error_line as _stage_fails

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "org/tiny-qwen"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_model_dir):
    """An HF hub cache holding REPO at COMMIT (branch main, tag v1), as snapshot_download leaves it."""
    cache = tmp_path_factory.mktemp("hf_home") / "hub"
    repo = cache / "models--org--tiny-qwen"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for file in tiny_model_dir.iterdir():
        (snapshot / file.name).symlink_to(file)  # the hub links snapshot files to blobs; a plain file works too
    (repo / "refs").mkdir()
    for ref in ("main", "v1"):
        (repo / "refs" / ref).write_text(COMMIT)
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hub_cache.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return hub_cache / "models--org--tiny-qwen" / "snapshots" / COMMIT


def _one_line(fn, *args, **kwargs) -> str:
    with pytest.raises(QerlError) as err:
        fn(*args, **kwargs)
    assert "\n" not in str(err.value)
    return str(err.value)


def _params(results_dir, stage: str) -> dict:
    import mlflow

    from qerl.tracking import tracking_uri

    link = json.loads((results_dir / "x" / "runs" / f"{stage}.json").read_text())
    return mlflow.MlflowClient(tracking_uri=tracking_uri(results_dir)).get_run(link["run_id"]).data.params


def test_quantize_stage_takes_a_hub_name(offline_hub, tmp_path):
    from qerl.quantize import main

    out = tmp_path / "q"
    run_main(main, ["--experiment", "x", "--model", REPO, "--revision", "v1", "--out", str(out),
                    "--config-json", json.dumps({"scheme": "nvfp4"}), "--results-dir", str(tmp_path)])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert json.loads((out / "quantize.json").read_text())["relative_weight_error"]["num_layers"] == 14
    params = _params(tmp_path, "quantize")
    assert params["model"] == REPO and params["model_revision"] == "v1" and params["model_commit"] == COMMIT


@pytest.mark.parametrize("revision", [None, "main", "v1", COMMIT])
def test_revision_resolves_to_the_cached_snapshot(offline_hub, revision):
    path = resolve_model(REPO, revision)
    assert path == offline_hub and model_commit(path) == COMMIT


def test_unknown_revision_and_uncached_name_are_one_line(offline_hub, capsys, tmp_path):
    line = _one_line(resolve_model, REPO, "v9")
    assert "revision v9 of org/tiny-qwen" in line and "HF_HUB_OFFLINE" in line
    assert f"hf download {REPO} --revision v9" in line and "main" in line  # what is cached
    line = _one_line(resolve_model, "org/absent", what="--model")
    assert line.startswith("--model: org/absent is not in the hub cache") and "hf download org/absent" in line
    from qerl.quantize import main

    line = _stage_fails(capsys, main, ["--experiment", "x", "--model", REPO, "--revision", "deadbeef", "--out",
                                       str(tmp_path / "q"), "--config-json", "{}"])
    assert "revision deadbeef" in line and not (tmp_path / "q").exists()


def test_hf_home_alone_locates_the_cache(offline_hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    assert resolve_model(REPO) == offline_hub  # $HF_HOME/hub, as huggingface_hub computes it


@pytest.fixture
def planted_hub(tmp_path, monkeypatch):
    """An offline hub cache holding REPO at COMMIT, and a model folder beside the repo's that planted refs aim at."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny-qwen"
    for folder in (repo / "snapshots" / COMMIT, repo / "snapshots" / "not-a-hash", cache / "elsewhere"):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo


@pytest.mark.parametrize("text", ["../../elsewhere", "not-a-hash", COMMIT[:39], COMMIT + "/../../../elsewhere"])
def test_a_planted_ref_cannot_steer_outside_snapshots(planted_hub, text):
    """The hub joins a ref file's text to snapshots/ unchecked: a ref must hold a 40-hex commit."""
    (planted_hub / "refs" / "evil").write_text(text)
    line = _one_line(resolve_model, REPO, "evil")
    assert f"hub cache ref {planted_hub / 'refs' / 'evil'} holds" in line and "40-hex commit hash" in line, line


def test_a_ref_outside_refs_and_a_snapshot_outside_snapshots_are_refused(planted_hub, tmp_path):
    outside = tmp_path / "outside-ref"
    outside.write_text(COMMIT)
    (planted_hub / "refs" / "linked").symlink_to(outside)
    assert "is not a file inside" in _one_line(resolve_model, REPO, "linked")
    other = "f" * 40
    (planted_hub / "snapshots" / other).symlink_to(planted_hub.parent / "elsewhere", target_is_directory=True)
    assert "not a snapshots/<commit> folder" in _one_line(resolve_model, REPO, other)
    assert resolve_model(REPO) == planted_hub / "snapshots" / COMMIT


@pytest.mark.parametrize("revision", ["../../planted", "/abs", "a\\b", "a\0b", ".x", "v1.lock", "a b"])
def test_a_revision_must_be_a_ref_name(planted_hub, revision):
    (planted_hub.parent / "planted").write_text("../../elsewhere")  # what refs/../../planted would read
    line = _one_line(resolve_model, REPO, revision)
    assert line.startswith(f"model: revision {revision!r} is not a branch, tag or commit hash"), line


@pytest.mark.parametrize("ref, match", [
    ("./no-such-dir", "./no-such-dir is not a directory"),
    ("resources/no-model", "resources/no-model is not a directory"),
    ("results/x/quantized", "results/x/quantized is not a directory"),
    ("bad..name", "'bad..name' is neither a local directory nor a valid hub repo id"),
])
def test_bad_references_are_one_line(offline_hub, ref, match):
    assert match in _one_line(resolve_model, ref)


def test_local_directory_checks(offline_hub, tmp_path, tiny_model_dir):
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    assert "no config.json" in _one_line(resolve_model, str(tmp_path))
    assert "applies to hub names only" in _one_line(resolve_model, str(tiny_model_dir), "main")


def test_evaluate_base_variant_resolves_the_hub_name(offline_hub, capsys, tmp_path, data_dir, tiny_model_dir):
    from qerl.evaluate import _variant_dirs, main

    dirs = _variant_dirs(["trained", "base"], {"trained": str(tiny_model_dir), "base": REPO}, COMMIT)
    assert dirs == {"trained": tiny_model_dir, "base": offline_hub}
    cfg = {"benchmarks": [{"name": "gsm8k"}], "variants": ["base"], "max_new_tokens": 2, "limit": 1}
    line = _stage_fails(capsys, main, ["--experiment", "x", "--trained", str(tiny_model_dir), "--base", REPO,
                                       "--revision", "v9", "--data-dir", str(data_dir), "--out",
                                       str(tmp_path / "e.json"), "--config-json", json.dumps(cfg)])
    assert line.startswith("error: --base: revision v9 of org/tiny-qwen")


def test_no_network_is_one_line(hub_cache, monkeypatch):
    """Online mode against an endpoint that refuses connections: the hub's own error path, no network used."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    line = _one_line(resolve_model, "org/absent")
    assert "org/absent is not in the hub cache" in line and "could not be reached" in line


def _http_error(cls, status: int):
    response = httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/org/x"))
    return cls(f"{status} Client Error\nmore details", response=response)


@pytest.mark.parametrize("error, match", [
    ("GatedRepoError", "org/x is gated: accept its terms on huggingface.co and set HF_TOKEN"),
    ("RepositoryNotFoundError", "hub repository org/x not found (misspelt, or private: set HF_TOKEN)"),
    ("RevisionNotFoundError", "org/x has no revision 'v2'"),
])
def test_hub_answers_are_one_line(monkeypatch, error, match):
    """What snapshot_download raises for a gated, missing or private repo or a missing revision (online)."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def fake_download(repo_id, **kwargs):
        assert kwargs["allow_patterns"] and "*.py" not in kwargs["allow_patterns"] and not kwargs["local_files_only"]
        raise _http_error(getattr(errors, error), 404)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert match in _one_line(resolve_model, "org/x", "v2")


def test_download_asks_only_for_safetensors_model_files():
    from huggingface_hub.utils import filter_repo_objects

    from qerl.hub import MODEL_FILES, SKIP_FILES

    repo = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
            "merges.txt", "tokenizer.model", "qwen.tiktoken", "model-00001-of-00002.safetensors",
            "model.safetensors.index.json", "pytorch_model.bin", "model.pt", "modeling_custom.py",
            "consolidated.safetensors", "onnx/model.onnx", "original/params.json", "README.md"]
    got = set(filter_repo_objects(repo, allow_patterns=MODEL_FILES, ignore_patterns=SKIP_FILES))
    assert got == set(repo[:10])
