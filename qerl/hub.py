"""Model references and checkpoint checks: a hub repo id or a local directory becomes a local, checked checkpoint.

    from qerl.hub import check_checkpoint, resolve_model
    path = resolve_model("Qwen/Qwen2.5-7B-Instruct", revision="main")  # <HF_HUB_CACHE>/models--.../snapshots/<sha>
    check_checkpoint(path)  # config.json, model_type and every safetensors header, without loading a tensor

Hub names are fetched as transformers does (huggingface_hub.snapshot_download, the same cache, HF_HOME /
HF_HUB_CACHE / HF_HUB_OFFLINE / HF_TOKEN), but only the files a safetensors model needs: no pickles, no custom code.
Every failure is one QerlError line naming the model and what to do.
"""
from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from qerl.errors import QerlError

# config / generation config / tokenizer / index (*.json), weights, vocab files; never *.bin/*.pt pickles or *.py code
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
# subfolders hold other formats (onnx/, original/, gguf/) and consolidated.* duplicates the weights for Mistral's
# own runtime: a transformers causal LM reads neither
SKIP_FILES = ["*/*", "consolidated*"]
_PATH_PREFIXES = ("/", ".", "~", "resources/")
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
COMMIT_HASH = re.compile(r"[0-9a-f]{40}")  # fullmatch only
_REF_RULES = (  # git check-ref-format's rules: (broken by, what a ref name has)
    (lambda r: not r or len(r) > 255, "1 to 255 characters"),
    (re.compile(r"[\x00-\x20\x7f~^:?*\[\\]").search, "no space, control character, NUL or any of ~ ^ : ? * [ \\"),
    (lambda r: ".." in r or "@{" in r or "//" in r or r == "@", "no '..', '@{' or '//'"),
    (lambda r: r.startswith("/") or r.endswith(("/", ".")), "no leading '/' and no trailing '/' or '.'"),
    (lambda r: any(p.startswith(".") or p.endswith(".lock") for p in r.split("/")),
     "no part starting with '.' or ending with '.lock'"),
)


def revision_problem(revision: str) -> str | None:
    """Why `revision` is not a branch, tag or commit name, or None: the hub joins it to its cache's refs/ folder
    and to URLs, so it must keep git's ref-name rules (no '..', no absolute path, no backslash or NUL)."""
    for broken, rule in _REF_RULES:
        if broken(revision):
            return f"is not a branch, tag or commit hash (a git ref name has {rule})"
    return None


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub computes it, read now (its constants are frozen at import)."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hub_offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE


def model_commit(path: str | Path) -> str | None:
    """The commit a hub snapshot directory holds (its name), None for a plain local directory."""
    path = Path(path)
    return path.name if path.parent.name == "snapshots" else None


def _looks_like_path(ref: str) -> bool:
    return ref.startswith(_PATH_PREFIXES) or ref.count("/") > 1 or os.path.lexists(ref)


def resolve_model(ref: str, revision: str | None = None, *, what: str = "model") -> Path:
    """A local model directory for `ref`: the directory itself, or the hub snapshot of repo id `ref` at
    `revision` (branch, tag or commit; default main), downloaded unless HF_HUB_OFFLINE is set."""
    ref = str(ref)
    path = Path(ref).expanduser()
    if _looks_like_path(ref):
        if not path.is_dir():
            raise QerlError(f"{what}: {ref} is not a directory (expected a local model directory or a hub repo id)")
        if not (path / "config.json").is_file():
            raise QerlError(f"{what}: {ref} is not a model directory (no config.json)")
        if revision:
            raise QerlError(f"{what}: {ref} is a local directory; a revision ({revision}) applies to hub names only")
        return path
    if revision is not None and (why := revision_problem(revision)):
        raise QerlError(f"{what}: revision {revision!r} {why}")
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(ref)
    except HFValidationError as err:
        raise QerlError(f"{what}: {ref!r} is neither a local directory nor a valid hub repo id ({err})") from None
    return Path(_snapshot(ref, revision, what))


def _snapshot(repo_id: str, revision: str | None, what: str) -> str:
    import httpx
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    offline, cache = hub_offline(), hub_cache_dir()
    name = f"{repo_id}@{revision}" if revision else repo_id
    repo_dir = _check_cached_ref(repo_id, revision, cache, what, offline)
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=offline,
                                 allow_patterns=MODEL_FILES, ignore_patterns=SKIP_FILES)
    except GatedRepoError:
        raise QerlError(f"{what}: hub repository {repo_id} is gated: accept its terms on huggingface.co and set "
                        f"HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise QerlError(f"{what}: hub repository {repo_id} not found (misspelt, or private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise QerlError(f"{what}: hub repository {repo_id} has no revision {revision!r} "
                        f"(expected a branch, tag or commit)") from None
    except LocalEntryNotFoundError as err:
        raise QerlError(_not_cached(repo_id, revision, what, offline, cache, err)) from None
    except HfHubHTTPError as err:
        raise QerlError(f"{what}: hub error for {name}: {_first_line(err)}") from None
    except (httpx.HTTPError, OSError) as err:
        raise QerlError(f"{what}: could not download {name} ({type(err).__name__}: {_first_line(err)})") from None
    snapshots = (repo_dir / "snapshots").resolve()
    if Path(path).resolve().parent != snapshots or not COMMIT_HASH.fullmatch(Path(path).name):
        raise QerlError(f"{what}: {name} resolved to {path}, not a snapshots/<commit> folder of {repo_dir}")
    return path


def _check_cached_ref(repo_id: str, revision: str | None, cache: Path, what: str, offline: bool) -> Path:
    """The repo's folder in the hub cache, after checking (offline) the refs/<revision> file the hub will read: a
    file inside refs/ holding a 40-hex commit, as the hub joins its text to snapshots/ unchecked. Online (the
    hub falls back to refs/ when the network fails), the snapshot folder returned is checked instead."""
    from huggingface_hub.file_download import repo_folder_name

    repo_dir = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    ref = repo_dir / "refs" / (revision or "main")
    if not offline or COMMIT_HASH.fullmatch(revision or "") or not os.path.lexists(ref):
        return repo_dir
    if not ref.resolve().is_relative_to((repo_dir / "refs").resolve()) or not ref.is_file():
        raise QerlError(f"{what}: hub cache ref {ref} is not a file inside {repo_dir / 'refs'}; delete it and "
                        "fetch again")
    with open(ref, encoding="utf-8", errors="replace") as f:
        text = f.read(100)
    if not COMMIT_HASH.fullmatch(text):
        raise QerlError(f"{what}: hub cache ref {ref} holds {text[:50]!r}, not a 40-hex commit hash; delete it "
                        "and fetch again")
    return repo_dir


def _not_cached(repo_id, revision, what, offline: bool, cache: Path, err: Exception) -> str:
    from huggingface_hub.file_download import repo_folder_name

    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    repo_dir = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    have = sorted(p.name for d in ("refs", "snapshots") if (repo_dir / d).is_dir() for p in (repo_dir / d).iterdir())
    missing = (f"revision {revision or 'main'} of {repo_id} is not in the hub cache {cache} (cached: "
               f"{', '.join(have)})" if have else f"{repo_id} is not in the hub cache {cache}")
    if offline:
        return (f"{what}: {missing} and HF_HUB_OFFLINE is set: fetch it with `{fetch}` or unset "
                f"HF_HUB_OFFLINE")
    return (f"{what}: {missing} and the hub could not be reached (no network? {_first_line(err.__cause__ or err)}): "
            f"run `{fetch}` where there is network, or give a local model directory")


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def read_json(file: str | Path) -> dict:
    """A JSON object from file; a missing file or bad JSON is one line naming it."""
    file = Path(file)
    if not file.is_file():
        raise QerlError(f"{file}: not found")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise QerlError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise QerlError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def safetensors_header(file: Path) -> dict[str, dict]:
    """name -> {dtype, shape, data_offsets} from a safetensors file's header, which must describe exactly the
    bytes present (a truncated download or garbage fails here, as one line, before any loader)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or n > _MAX_HEADER:
            raise QerlError(f"{file}: not a safetensors file (no valid header; {size} bytes)")
        if 8 + n > size:
            raise QerlError(f"{file}: truncated ({size} bytes, its header alone needs {8 + n}); download it again")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError):
        raise QerlError(f"{file}: not a safetensors file (its header is not safetensors JSON)") from None
    data_end = 8 + n + max(ends, default=0)
    if data_end > size:
        raise QerlError(f"{file}: truncated ({size} bytes, its header describes {data_end}); download it again")
    header.pop("__metadata__", None)
    return header


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise QerlError(f"{index}: no weight_map")
        files = [path / f for f in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise QerlError(f"{index}: names {file.name}, which is missing from {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt"))
        why = f" ({', '.join(pickles)} are pickles, which are not loaded: save as safetensors)" if pickles else ""
        raise QerlError(f"{path}: has no weights (no *.safetensors file){why}")
    return files


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in a checkpoint directory, from the safetensors headers (no tensor data)."""
    shapes = {}
    for file in _weight_files(Path(path)):
        shapes.update({k: tuple(t["shape"]) for k, t in safetensors_header(file).items()})
    return shapes


def _check_model_type(cfg_file: Path, cfg: dict) -> None:
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        raise QerlError(f"{cfg_file}: no model_type (expected a transformers config such as model_type 'qwen2')")
    if model_type not in CONFIG_MAPPING_NAMES:
        code = "; its custom code (auto_map) is not run" if "auto_map" in cfg else ""
        raise QerlError(f"{cfg_file}: model_type {model_type!r} is not known to transformers {__version__}{code}")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise QerlError(f"{cfg_file}: model_type {model_type!r} has no causal LM in transformers {__version__}")


def check_checkpoint(path: str | Path, what: str = "model") -> Path:
    """A HF causal-LM checkpoint directory whose config and weight files are readable; one line otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise QerlError(f"{what}: directory not found: {path}")
    if not (path / "config.json").is_file():
        raise QerlError(f"{what}: {path} has no config.json (not a HF checkpoint directory)")
    cfg = read_json(path / "config.json")
    tensor_shapes(path)
    _check_model_type(path / "config.json", cfg)
    return path
