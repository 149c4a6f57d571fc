"""Stage 1: quantize a base checkpoint to NVFP4 (compressed-tensors) with llmcompressor.

    python -m qerl.quantize --experiment demo --model resources/smollm2-135m-instruct \
        --out results/demo/quantized --config config/config.yaml

--model is a local checkpoint directory or a hub repo id (e.g. Qwen/Qwen2.5-7B-Instruct, fetched into the HF cache
at --revision; HF_HUB_OFFLINE=1 uses the cache only).

Writes the checkpoint (loadable by vLLM and by qerl.quant.loader) and quantize.json inside it: scheme, seconds,
bytes per tensor kind, the model-size ratio to bf16 and the per-layer relative weight error.
"""
from __future__ import annotations

from pathlib import Path

from qerl.checkpoint_guard import check_config_matches_weights
from qerl.hub import check_checkpoint, model_commit, resolve_model
from qerl.io import atomic_dir, atomic_write_json
from qerl.stage import default_run_file, load_section, run_main, stage_parser, tracking_args


def _calibration_texts(data_json: str | None, model: Path, n: int) -> list[str]:
    """nvfp4-awq calibrates on the training prompts, rendered with the chat template as in training."""
    from transformers import AutoTokenizer

    from qerl.config import DataConfig
    from qerl.data import build_prompt, load_records

    data = DataConfig.model_validate_json(data_json)
    records = load_records(data.source, split=data.split, question_field=data.question_field,
                           answer_field=data.answer_field, config_name=data.config_name, limit=n)
    tok = AutoTokenizer.from_pretrained(model)
    return [build_prompt(tok, r["question"], data.template) for r in records]


def main(argv: list[str] | None = None) -> None:
    p = stage_parser("python -m qerl.quantize", __doc__)
    p.add_argument("--model", required=True, help="hub name or local HF checkpoint directory")
    p.add_argument("--revision", help="hub branch, tag or commit of --model (default: main)")
    p.add_argument("--out", required=True)
    p.add_argument("--calibration-data-json", help="DataConfig JSON of the training prompts (nvfp4-awq)")
    args = p.parse_args(argv)
    cfg = load_section(args, "quantize")
    model_dir = check_checkpoint(resolve_model(args.model, args.revision, what="--model"), "--model")
    check_config_matches_weights(model_dir)  # before any MLflow run or model: a lying config sizes nothing

    from qerl.quant.compress import quantize_checkpoint
    from qerl.tracking import stage_run

    texts = None
    if cfg.scheme == "nvfp4-awq":
        if not args.calibration_data_json:
            from qerl.errors import QerlError
            raise QerlError("quantize.scheme nvfp4-awq needs --calibration-data-json (the training data)")
        texts = _calibration_texts(args.calibration_data_json, model_dir, cfg.calibration_samples)
    hub = {"model_revision": args.revision, "model_commit": model_commit(model_dir)}
    params = {"model": args.model, **{k: v for k, v in hub.items() if v}, **cfg.model_dump(mode="json")}
    with stage_run(experiment=args.experiment, stage="quantize", params=params,
                   run_file=default_run_file(args, "quantize"), **tracking_args(args)) as run:
        with atomic_dir(args.out) as tmp:
            report = quantize_checkpoint(model_dir, tmp, cfg.scheme, calibration_texts=texts,
                                         num_calibration_samples=cfg.calibration_samples,
                                         max_seq_length=cfg.max_seq_length)
            atomic_write_json(Path(tmp) / "quantize.json", report)
        run.log_report(report)
        run.log_artifact(Path(args.out) / "quantize.json")
        run.describe(f"quantized `{args.model}` ({cfg.scheme}) -> `{args.out}`")
    print(f"quantized {args.model} ({cfg.scheme}) -> {args.out}")


if __name__ == "__main__":
    run_main(main)
