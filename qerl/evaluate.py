"""Stage 4: evaluate the trained (merged) model, the base and the quantized base on the configured benchmarks.

    python -m qerl.evaluate --experiment demo --trained results/demo/merged --quantized results/demo/quantized \
        --base resources/smollm2-135m-instruct --data-dir ../shared/data --out results/demo/eval.json \
        --config config/config.yaml

Variants: trained = the merged 16-bit checkpoint, base = the dense original, quantized_base = the quantize stage's
output as training saw it (packed NVFP4/MXFP4 through qerl's loader, or bitsandbytes NF4 for the QLoRA rows).
Per benchmark and variant: greedy accuracy and/or sampled pass@1 over k samples, with standard error and a 95%
interval, mean response length and truncation count (eval.json, validated against
workflow/schemas/eval.schema.json), and per-problem records (JSONL, logged to MLflow).
"""
from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timezone
from pathlib import Path

from qerl.errors import QerlError
from qerl.hub import check_checkpoint, model_commit, resolve_model
from qerl.paths import eval_records_dir
from qerl.stage import default_run_file, load_section, run_main, stage_parser, tracking_args

log = logging.getLogger("qerl.evaluate")


def model_dir(ref: str | Path, revision: str | None = None, what: str = "model") -> Path:
    """The checked local directory of a model reference (a directory, or a hub name fetched at revision)."""
    from qerl.checkpoint_guard import check_config_matches_weights

    path = check_checkpoint(resolve_model(str(ref), revision, what=what), what)
    check_config_matches_weights(path)
    return path


def check_loadable(path: Path, flag: str, dtype: str) -> None:
    """A quantized checkpoint the torch engines can load here (compressed-tensors NVFP4/MXFP4, or bitsandbytes NF4
    on a device bitsandbytes runs it on); a one-line error naming the flag and directory otherwise."""
    from qerl.quant.loader import checkpoint_format
    from qerl.quant.nf4 import require_nf4
    from qerl.trainer import resolve_device_dtype

    if checkpoint_format(path) == "nf4":  # any other quantization_config than ours raised there
        require_nf4(resolve_device_dtype(dtype)[0], f"{flag} {path} (bitsandbytes NF4)")


def load_for_eval(path: str | Path, dtype: str):
    """A dense HF model, the packed FP4 model for a compressed-tensors checkpoint (never a bf16 copy), or the
    bitsandbytes NF4 model (QLoRA's base as training ran on it) for an NF4 checkpoint; frozen (nothing trains it:
    no autograd state, and the engines may stack its projections, qerl.quant.grouped)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.quant.loader import checkpoint_format, load_quantized_model
    from qerl.quant.nf4 import load_nf4_model
    from qerl.trainer import resolve_device_dtype

    device, torch_dtype = resolve_device_dtype(dtype)
    p = model_dir(path)
    fmt = checkpoint_format(p)
    if fmt == "nf4":
        model = load_nf4_model(p, torch_dtype, device)
    elif fmt != "dense":
        model = load_quantized_model(p, dtype=torch_dtype, device=device)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch_dtype).to(device)
    return model.eval().requires_grad_(False), AutoTokenizer.from_pretrained(str(p))


def _records(entry, data_dir: str | None, limit: int | None):
    from qerl.benchmarks import get_spec, load_benchmark
    from qerl.data import load_records

    spec = get_spec(entry.name)
    if entry.source:
        recs = load_records(entry.source, split="test", question_field=spec.question_field,
                            answer_field=spec.answer_field, limit=limit, answer_kind=spec.kind)
        return spec, recs
    return load_benchmark(entry.name, data_dir, limit=limit)


def _modes(cfg, spec, entry):
    from qerl.rollout import SamplingParams

    common = {"max_tokens": cfg.max_new_tokens, "stop": tuple(cfg.stop), "seed": cfg.seed}
    if cfg.greedy:
        yield "greedy", 1, SamplingParams(temperature=0.0, **common)
    if cfg.sampled:
        yield "sampled", entry.k or spec.k, SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, **common)


def evaluate_variant(variant: str, path: str, cfg, benchmarks: list, records_dir: Path, run, progress=None) -> dict:
    from qerl.evaluation import benchmark_entry, evaluate_benchmark, result_key
    from qerl.rollout import make_engine

    if cfg.engine == "vllm":  # vLLM loads the checkpoint itself (NVFP4 included): no torch copy
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        engine = make_engine("vllm", None, tok, model_path=path)
    else:
        model, tok = load_for_eval(path, cfg.dtype)
        engine = make_engine(cfg.engine, model, tok)
    results = {}
    for entry, (spec, records) in zip(cfg.benchmarks, benchmarks):
        template = cfg.template or spec.template
        for mode, k, sampling in _modes(cfg, spec, entry):
            t0 = time.perf_counter()
            summary, per_problem = evaluate_benchmark(engine, tok, records, kind=spec.kind, template=template,
                                                      sampling=sampling, k=k, batch_size=cfg.batch_size,
                                                      grading_timeout_s=cfg.grading_timeout_s)
            key = result_key(entry.name, variant, mode)
            rec_path = records_dir / f"{key.replace('/', '_')}.jsonl"
            rec_path.parent.mkdir(parents=True, exist_ok=True)
            rec_path.write_text("".join(json.dumps(r) + "\n" for r in per_problem))
            results[key] = benchmark_entry(summary, benchmark=entry.name, variant=variant, model_path=path,
                                           per_problem_path=str(rec_path), seconds=time.perf_counter() - t0)
            tag = key.replace("/", ".")
            run.log_metrics({f"{tag}.accuracy": summary["accuracy"], f"{tag}.stderr": summary["stderr"],
                             f"{tag}.mean_response_tokens": summary["mean_response_tokens"]})
            run.log_artifact(rec_path, artifact_path="per_problem")
            log.info("%s: %.4f +- %.4f (%d problems, k=%d)", key, summary["accuracy"], summary["stderr"],
                     summary["n_problems"], summary["k"])
            if progress is not None:
                progress.step(result=key, accuracy=float(summary["accuracy"]))
    engine.close()
    return results


def logged_params(cfg) -> dict:
    """The eval section as MLflow params, less temperature/top_p when no sampled evaluation runs."""
    params = cfg.model_dump(mode="json")
    if not cfg.sampled:
        for key in ("temperature", "top_p"):
            params.pop(key)
    return params


def _variant_dirs(variants: list[str], paths: dict, revision: str | None) -> dict[str, Path]:
    """Each evaluated variant's checked local directory; --revision pins the base, the only hub-named one."""
    flags = {"trained": "--trained", "base": "--base", "quantized_base": "--quantized"}
    return {v: model_dir(paths[v], revision if v == "base" else None, flags[v]) for v in variants}


def main(argv: list[str] | None = None) -> None:
    p = stage_parser("python -m qerl.evaluate", __doc__)
    p.add_argument("--trained", required=True, help="merged checkpoint (results/<exp>/merged)")
    p.add_argument("--base", help="base model (hub name or dir) for the 'base' variant")
    p.add_argument("--revision", help="hub branch, tag or commit of --base (default: main)")
    p.add_argument("--quantized", help="quantized base for the 'quantized_base' variant")
    p.add_argument("--data-dir", help="folder holding <benchmark>/test.jsonl")
    p.add_argument("--out", required=True, help="eval.json path")
    args = p.parse_args(argv)
    cfg = load_section(args, "eval")
    paths = {"trained": args.trained, "base": args.base, "quantized_base": args.quantized}
    for variant in cfg.variants:
        if not paths[variant]:
            raise QerlError(f"eval.variants has '{variant}' but no --{variant.split('_')[0]} path was given")
    data_dir = cfg.data_dir or args.data_dir
    # fail on a bad benchmark or model path before loading any model
    benchmarks = [_records(entry, data_dir, cfg.limit) for entry in cfg.benchmarks]
    dirs = _variant_dirs(cfg.variants, paths, args.revision)
    if cfg.engine != "vllm":  # vLLM reads the quantization_config itself
        for variant, path in dirs.items():
            check_loadable(path, f"--{variant.split('_')[0]}", cfg.dtype)

    from qerl.evaluation import validate_eval
    from qerl.io import atomic_write_json
    from qerl.tracking import stage_run

    out = Path(args.out)
    records_dir = eval_records_dir(out)
    hub = {"model_revision": args.revision, "model_commit": model_commit(dirs["base"]) if "base" in dirs else None}
    params = {**paths, **{k: v for k, v in hub.items() if v}, **logged_params(cfg)}
    with stage_run(experiment=args.experiment, stage="evaluate", params=params,
                   run_file=default_run_file(args, "evaluate"), **tracking_args(args)) as run:
        from qerl.progress import StepProgress

        runs = sum(len(list(_modes(cfg, spec, entry))) for entry, (spec, _) in zip(cfg.benchmarks, benchmarks))
        progress = StepProgress(f"evaluate {args.experiment}", runs * len(cfg.variants), every_s=0.0)  # each a result
        results = {}
        for variant in cfg.variants:
            results.update(evaluate_variant(variant, str(dirs[variant]), cfg, benchmarks, records_dir, run, progress))
        progress.close()
        doc = {"experiment": args.experiment, "created": datetime.now(timezone.utc).isoformat(),
               "model": {"path": args.trained, "base": args.base or "", "quantized": args.quantized or ""},
               "engine": cfg.engine, "mlflow_run_id": run.run_id, "benchmarks": results}
        atomic_write_json(out, validate_eval(doc))
        run.log_artifact(out)
        from qerl.report import accuracy_markdown

        run.describe(accuracy_markdown(doc))
    print(f"wrote {out}")


if __name__ == "__main__":
    run_main(main)
