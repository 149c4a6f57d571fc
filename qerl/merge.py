"""Stage 3: merge the LoRA adapter into the (dequantized) base; write a plain bf16 HF checkpoint.

The base is what training ran on: dense, compressed-tensors NVFP4/MXFP4, or bitsandbytes NF4 (QLoRA), dequantized
to float32 before the merge; the output loads with transformers alone (no bitsandbytes, no compressed-tensors).

    python -m qerl.merge --experiment demo --base results/demo/quantized --adapter results/demo/adapter \
        --out results/demo/merged --config config/config.yaml

merge.json (inside the output) records max |merged - (deq(W) + B A * scale)| over all layers and, under
merged_from, the base, its format and quantization_config, and the adapter with its rank, alpha and scaling.
"""
from __future__ import annotations

from pathlib import Path

from qerl.errors import QerlError
from qerl.checkpoint_guard import check_config_matches_weights, drop_remote_code
from qerl.hub import check_checkpoint, resolve_model
from qerl.io import atomic_dir, atomic_write_json
from qerl.stage import default_run_file, load_section, require_dir, run_main, stage_parser, tracking_args


def copy_full_model(model_dir: str | Path, out_dir: str | Path, dtype) -> dict:
    """train.mode full writes whole weights instead of an adapter: the merged model is that model in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return {"mode": "full", "dtype": str(dtype).removeprefix("torch."), "merged_layers": 0, "max_abs_diff": 0.0}


def main(argv: list[str] | None = None) -> None:
    p = stage_parser("python -m qerl.merge", __doc__)
    p.add_argument("--base", required=True, help="the checkpoint training ran on (quantized or bf16; dir or hub name)")
    p.add_argument("--adapter", required=True, help="PEFT adapter directory written by qerl.train")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args(argv)
    cfg = load_section(args, "merge")
    base = check_checkpoint(resolve_model(args.base, what="--base"), "--base")
    check_config_matches_weights(base)
    require_dir(args.adapter, "--adapter", must_contain=())
    full = not (Path(args.adapter) / "adapter_config.json").exists()
    if full and cfg.requantize:
        raise QerlError("merge.requantize: not available for full fine-tuning output; quantize it separately")

    import torch

    from qerl.merging import check_merge_inputs, merge_adapter
    from qerl.tracking import stage_run

    if not full:
        check_merge_inputs(base, args.adapter)  # a bad adapter or base fails here, before the MLflow run opens

    params = {"base": args.base, "adapter": args.adapter, "dtype": args.dtype, **cfg.model_dump(mode="json")}
    with stage_run(experiment=args.experiment, stage="merge", params=params, run_file=default_run_file(args, "merge"),
                   **tracking_args(args)) as run:
        with atomic_dir(args.out) as tmp:
            if full:
                check_checkpoint(args.adapter, "--adapter (full fine-tuning output)")
                report = copy_full_model(args.adapter, tmp, getattr(torch, args.dtype))
            else:
                report = merge_adapter(base, args.adapter, tmp, dtype=getattr(torch, args.dtype),
                                       requantize=cfg.requantize)
            drop_remote_code(tmp, base)  # a base's auto_map / .py files never reach the merged output
            atomic_write_json(Path(tmp) / "merge.json", report)
        run.log_report(report)
        if "merged_from" in report:
            run.set_tags({f"merged_from.{k}": str(v) for k, v in report["merged_from"].items()})
        run.log_artifact(Path(args.out) / "merge.json")
        run.describe(f"merged `{args.adapter}` into `{args.base}` -> `{args.out}`")
    print(f"merged {args.adapter} into {args.base} -> {args.out}")


if __name__ == "__main__":
    run_main(main)
