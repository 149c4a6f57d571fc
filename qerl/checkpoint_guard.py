"""What qerl trusts of a checkpoint: its config must agree with its weights, and its code is never carried on.

    from qerl.checkpoint_guard import check_config_matches_weights, drop_remote_code
    check_config_matches_weights("resources/model")   # before any model is built from config.json
    drop_remote_code("results/exp/quantized", source="resources/model")   # after writing an output

A model skeleton is built from config.json alone, so a config that lies (num_hidden_layers 1000000000, a
hidden_size 1000 times the weights') would make quantize or the loaders allocate until killed. The safetensors
headers (names and shapes, no tensor data) bound it: the layer count, embedding, attention and MLP sizes of the
config must be those of the weights, dense (`.weight`, out x in) or packed FP4 (`.weight_packed`, out x in/2).

A checkpoint's `auto_map` and `.py` files are code that `trust_remote_code` would run; qerl never runs them and
never writes them into its outputs, so an output cannot run code later either.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

from qerl.errors import QerlError
from qerl.hub import read_json, tensor_shapes

log = logging.getLogger(__name__)

DIM_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "head_dim")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_CODE_CONFIGS = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def _dims(cfg_file: Path, cfg: dict) -> dict[str, int]:
    """The config's size keys, each a positive integer (1e9 reads as the float 1000000000.0: refused too)."""
    dims = {}
    for key in DIM_KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise QerlError(f"{cfg_file}: {key} is {value!r}, expected a positive integer")
        dims[key] = value
    return dims


def _expected_linears(d: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(out, in) of the first decoder layer's projections, for the keys the config has."""
    hidden, heads = d.get("hidden_size"), d.get("num_attention_heads")
    head_dim = d.get("head_dim") or (hidden // heads if hidden and heads else None)
    kv = d.get("num_key_value_heads", heads)
    inter = d.get("intermediate_size")
    want = {}
    if hidden and heads and head_dim:
        want["self_attn.q_proj"] = (heads * head_dim, hidden)
        want["self_attn.o_proj"] = (hidden, heads * head_dim)
        if kv:
            want["self_attn.k_proj"] = want["self_attn.v_proj"] = (kv * head_dim, hidden)
    if hidden and inter:
        want["mlp.gate_proj"] = want["mlp.up_proj"] = (inter, hidden)
        want["mlp.down_proj"] = (hidden, inter)
    return want


_PROJ_KEYS = {"self_attn.q_proj": ("num_attention_heads", "head_dim", "hidden_size"),
              "self_attn.o_proj": ("num_attention_heads", "head_dim", "hidden_size"),
              "self_attn.k_proj": ("num_key_value_heads", "head_dim", "hidden_size"),
              "self_attn.v_proj": ("num_key_value_heads", "head_dim", "hidden_size")}


def _check_linears(cfg_file: Path, cfg: dict, d: dict[str, int], shapes: dict, first: int) -> None:
    if (cfg.get("quantization_config") or {}).get("quant_method") == "bitsandbytes":
        return  # NF4 stores flattened bytes: the layer count and embedding still bound the skeleton
    for proj, (out, inp) in _expected_linears(d).items():
        for suffix, stored in ((".weight", (out, inp)), (".weight_packed", (out, inp // 2))):
            name = next((n for n in shapes if n.endswith(f"layers.{first}.{proj}{suffix}")), None)
            if name is not None and len(shapes[name]) == 2 and tuple(shapes[name]) != stored:
                keys = _PROJ_KEYS.get(proj, ("intermediate_size", "hidden_size"))
                said = ", ".join(f"{k} {d[k]}" for k in keys if k in d)
                raise QerlError(f"{cfg_file}: {said} disagree with the weights: {name} has shape "
                                f"{list(shapes[name])}, expected {list(stored)} from the config")


def check_config_matches_weights(path: str | Path) -> None:
    """One line naming config.json and the key when its sizes disagree with the safetensors headers of `path`."""
    path = Path(path)
    cfg_file = path / "config.json"
    cfg = read_json(cfg_file)
    d = _dims(cfg_file, cfg)
    shapes = tensor_shapes(path)
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.search(name))}
    if "num_hidden_layers" in d and layers and d["num_hidden_layers"] != len(layers):
        raise QerlError(f"{cfg_file}: num_hidden_layers is {d['num_hidden_layers']}, but the weights hold "
                        f"{len(layers)} decoder layers")
    embed = next((n for n in shapes if n.endswith("embed_tokens.weight")), None)
    if embed is not None and len(shapes[embed]) == 2:
        for key, size in (("vocab_size", shapes[embed][0]), ("hidden_size", shapes[embed][1])):
            if key in d and d[key] != size:
                raise QerlError(f"{cfg_file}: {key} is {d[key]}, but {embed} has shape {list(shapes[embed])}")
    if layers:
        _check_linears(cfg_file, cfg, d, shapes, min(layers))


def drop_remote_code(out_dir: str | Path, source: str | Path | None = None) -> list[str]:
    """Remove every .py file and `auto_map` entry from a written checkpoint directory; log a line when the source
    had custom code. Returns what was dropped."""
    out_dir = Path(out_dir)
    dropped = [str(p.relative_to(out_dir)) for p in sorted(out_dir.rglob("*.py"))]
    for rel in dropped:
        (out_dir / rel).unlink()
    for name in _CODE_CONFIGS:
        file = out_dir / name
        if file.is_file() and "auto_map" in (doc := read_json(file)):
            doc.pop("auto_map")
            from qerl.io import atomic_write_json

            atomic_write_json(file, doc)
            dropped.append(f"{name}:auto_map")
    if source is not None:
        src = Path(source)
        had = sorted(p.name for p in src.glob("*.py")) + [f"{n}:auto_map" for n in _CODE_CONFIGS
                                                           if (src / n).is_file() and "auto_map" in read_json(src / n)]
        if had:
            log.info("%s has custom code (%s): not copied into %s (qerl never runs or writes checkpoint code)",
                     src, ", ".join(had), out_dir)
    return dropped
