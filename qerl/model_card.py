"""The adapter's model card (README.md in the adapter folder): what it was trained from, how, on what, for how long.

    text = adapter_card(cfg, base="results/qwen7b/quantized", experiment="qwen7b", history=trainer.log_history,
                        eval_json=Layout("results").eval_json("qwen7b"))

Written by the train stage over peft's empty template. The accuracy comes later (the evaluate stage's eval.json,
with 95% intervals): the card says where, since a stage never rewrites another stage's output.
"""
from __future__ import annotations

import json
from pathlib import Path

_LAST_KEYS = ("reward", "rewards/correctness/mean", "completions/mean_length", "entropy", "aqn/sigma")


def _source_model(base: str | Path) -> str | None:
    """The model a quantized checkpoint came from, as its config names it (None when unknown)."""
    try:
        config = json.loads((Path(base) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("_name_or_path") if isinstance(config, dict) else None
    return name if isinstance(name, str) and name else None


def _method(cfg) -> str:
    lora = cfg.lora
    parts = [f"`{cfg.mode}`"]
    if cfg.mode != "full":
        parts.append(f"LoRA r {lora.lora_r}, alpha {lora.lora_alpha} on {', '.join(lora.target_modules)}")
    parts.append(f"GRPO loss `{cfg.loss_type}` (epsilon {cfg.epsilon}/{cfg.epsilon_high}, beta {cfg.beta})")
    aqn = cfg.aqn
    if aqn is None or aqn.schedule == "none":
        parts.append("no quantization noise")
    else:
        parts.append(f"AQN {aqn.schedule}, sigma {aqn.sigma_start:g} -> {aqn.sigma_end:g} over {aqn.num_stages} stages")
    return "; ".join(parts)


def adapter_card(cfg, *, base: str | Path, experiment: str | None, history: list[dict],
                 eval_json: str | Path | None = None) -> str:
    """Markdown with a YAML header (the keys the Hub reads: base_model, library_name, tags); eval_json: where the
    evaluate stage writes this experiment's accuracy (qerl.paths.Layout.eval_json)."""
    source = _source_model(base)
    steps = max((int(row.get("step", 0)) for row in history), default=0)
    last = history[-1] if history else {}
    data = cfg.data
    tags = ["qerl", "grpo", "lora" if cfg.mode != "full" else "full-finetune"]
    if cfg.mode == "qlora_fp4":
        tags.append("nvfp4")
    if cfg.aqn is not None and cfg.aqn.schedule != "none":
        tags.append("aqn")
    header = ["---", *([f"base_model: {json.dumps(source)}"] if source else []), "library_name: peft",
              "tags:", *[f"- {t}" for t in tags], "---", ""]
    title = f"# {experiment} adapter" if experiment else "# qerl adapter"
    rows = [
        ("base checkpoint", f"`{base}`" + (f" (from `{source}`)" if source else "")),
        ("method", _method(cfg)),
        ("data", f"`{data.source}`" + (f" ({data.config_name})" if data.config_name else "")
         + f", split {data.split}, answers graded as `{data.answer_kind}`, template `{data.template}`"
         + (f", first {data.limit} records" if data.limit else "")),
        ("training", f"{steps} steps of {cfg.batch_size} prompts x {cfg.num_generations} completions, learning rate "
                     f"{cfg.learning_rate:g} ({cfg.lr_scheduler_type}), completions up to {cfg.max_completion_length}"
                     f" tokens, rewards {', '.join(cfg.rewards)}, seed {cfg.seed}"),
        ("last step", ", ".join(f"{k} {last[k]:.4g}" for k in _LAST_KEYS if isinstance(last.get(k), (int, float)))
         or "-"),
    ]
    lines = [*header, title, "", "Trained with [qerl](https://arxiv.org/abs/2510.11696)'s pipeline (QeRL: GRPO over "
             "an NVFP4 base with Adaptive Quantization Noise).", "", "| | |", "|---|---|",
             *[f"| {k} | {v} |" for k, v in rows], ""]
    where = (f"`{eval_json}` (`snakemake --cores 1 {eval_json}`)" if eval_json is not None
             else "the evaluate stage's eval.json")
    lines += [f"Accuracy on the configured benchmarks, with 95% intervals: {where}; the per-step curves: "
              "`metrics.csv` and `training_curves.png` beside this card.", "",
              *_load_snippet(cfg, base)]
    if cfg.train_norms and cfg.mode != "full":
        lines += ["The RMSNorm scales were trained too (saved beside the adapter); `python -m qerl.merge` applies "
                  "them with the adapter.", ""]
    return "\n".join(lines)


def _load_snippet(cfg, base) -> list[str]:
    if cfg.mode == "full":
        return ["```python", "from transformers import AutoModelForCausalLM", "",
                "model = AutoModelForCausalLM.from_pretrained(\"path/to/this/folder\")", "```", ""]
    load = (["from qerl.quant.loader import load_quantized_model", "",
             f"base = load_quantized_model({json.dumps(str(base))})"] if cfg.mode == "qlora_fp4" else
            ["from transformers import AutoModelForCausalLM", "",
             f"base = AutoModelForCausalLM.from_pretrained({json.dumps(str(base))})"])
    return ["```python", "from peft import PeftModel", *load,
            "model = PeftModel.from_pretrained(base, \"path/to/this/folder\")", "```", ""]
