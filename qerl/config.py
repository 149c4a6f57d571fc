"""Typed experiment config: the single source of truth for config/config.yaml and its JSON Schema.

    python -m qerl.config schema > workflow/schemas/config.schema.yaml   # regenerate the schema
    python -m qerl.config check config/config.yaml                       # validate, one line per problem
    python -m qerl.config memory config/config.yaml                      # GPU memory per rank (qerl.memory)

Knob names follow TRL where TRL has one (num_generations, beta, epsilon, epsilon_high, loss_type, learning_rate,
max_completion_length, lora_r, lora_alpha); AQN uses the paper's (sigma_start, sigma_end, num_stages). Every section
forbids unknown keys, so a typo fails at parse time with the key's dotted path.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qerl.config_input import (EXPERIMENT_NAME, MethodName, ModelRef, ResultsDir, Revision, StopString,
                               load_yaml_file)
from qerl.errors import QerlError
from qerl.launch import nodes_problem

QuantScheme = Literal["nvfp4", "nvfp4-awq", "mxfp4", "bf16", "nf4"]
TrainMode = Literal["qlora_fp4", "lora", "qlora_nf4", "full"]


class _Section(BaseModel):
    # inf/nan pass every bound check (inf > 0) and would only blow up hours into a run
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def _check_reward_name(spec: str) -> None:
    """Builtin names are checked by name; import paths by syntax and by their top-level package being installed
    (nothing is imported here: the config parser must not run user code)."""
    from qerl.rewards import BUILTIN_REWARDS

    if spec in BUILTIN_REWARDS:
        return
    module, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module or not _DOTTED.match(module) or not attr.isidentifier():
        raise ValueError(f"reward {spec!r} is neither a builtin ({', '.join(BUILTIN_REWARDS)}) nor an import "
                         "path 'pkg.mod:fn'")
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise ValueError(f"reward {spec!r}: no installed module {module.split('.')[0]!r}")


class QuantizeConfig(_Section):
    scheme: QuantScheme = Field("nvfp4", description="nvfp4 (data-free RTN), nvfp4-awq, mxfp4, bf16 or nf4")
    calibration_samples: int = Field(64, ge=1, description="prompts used to calibrate nvfp4-awq")
    max_seq_length: int = Field(512, ge=16, description="calibration sequence length")


class DataConfig(_Section):
    source: str = Field(..., description="hub dataset name, or a local .jsonl/.json/.parquet file or directory")
    config_name: str | None = Field(None, description="hub dataset config, e.g. 'main' for openai/gsm8k")
    split: str = "train"
    question_field: str | None = Field(None, description="None: detected from the known formats")
    answer_field: str | None = None
    answer_kind: Literal["gsm8k", "math", "aime", "amc", "numeric"] = "gsm8k"
    template: str = Field("qerl_think", description="qerl_think, boxed, answer_line, or a string with {question}")
    limit: int | None = Field(None, ge=1, description="use only the first N records")


class LoraSection(_Section):
    lora_r: int = Field(32, ge=1)
    lora_alpha: int = Field(64, ge=1)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    fused: bool = Field(True, description="training forward/backward of each LoRA layer as one autograd node "
                                          "(qerl.fused_lora); false: peft's own ops")


class AQNConfig(_Section):
    schedule: Literal["exponential", "linear", "cosine", "constant", "none"] = "exponential"
    sigma_start: float = Field(1e-2, gt=0)
    sigma_end: float = Field(5e-4, gt=0)
    num_stages: int = Field(10, ge=2, description="K equal stages over the run; stage 0 is noise-free")

    @model_validator(mode="after")
    def _decays(self):
        if self.sigma_end > self.sigma_start:
            raise ValueError(f"sigma_end ({self.sigma_end}) must be <= sigma_start ({self.sigma_start}): "
                             "the noise decays over the run")
        return self


class RolloutConfig(_Section):
    engine: Literal["torch", "paged", "vllm"] = Field(
        "torch", description="torch: static KV cache for every row of the step (CUDA graphs); paged: a pool of KV "
        "blocks with continuous batching, prefix sharing and preemption (sized from free memory); vllm")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop: list[StopString] = []
    gpu_memory_utilization: float = Field(0.35, gt=0.0, le=1.0, description="vllm: fraction of the card; paged: "
                                          "fraction of the memory free when a rollout starts, for the KV pool")
    block_size: int = Field(16, ge=1, description="paged: tokens per KV block")
    max_num_batched_tokens: int = Field(8192, ge=16, description="paged: tokens one forward may carry (prefill "
                                        "chunks + one per decoding row)")
    max_num_seqs: int | None = Field(None, ge=1, description="paged: rows decoded at once (None: as blocks allow)")
    compile: bool | Literal["auto"] = Field("auto", description="torch / paged: torch.compile the decode step in its "
                                            "CUDA graphs (auto: on CUDA; paged: each decoder layer, one compile)")
    keep_resident: bool = Field(True, description="paged: keep KV pool, graphs, copies across updates if both fit")
    weights: Literal["policy", "nvfp4"] = Field("policy", description="mode full on several GPUs: roll out on the "
                                                "trained weights gathered whole, or an NVFP4 copy (qerl.fp4_rollout)")


class TrainConfig(_Section):
    mode: TrainMode = Field("qlora_fp4", description="qlora_fp4 (QeRL), lora (16-bit), qlora_nf4, full")
    data: DataConfig
    rewards: list[str] = Field(["correctness", "format"], description="builtin names or dotted import paths")
    reward_weights: list[float] | None = None
    num_generations: int = Field(8, ge=2, description="G: completions per prompt")
    batch_size: int = Field(8, ge=1, description="prompts per step (the paper's batch)")
    micro_batch_size: int = Field(8, ge=1, description="completions per forward/backward (grad accumulation)")
    max_steps: int | None = Field(None, ge=1, description="None: num_train_epochs over the dataset")
    num_train_epochs: float = Field(1.0, gt=0)
    num_iterations: int = Field(1, ge=1, description="policy updates per rollout batch (mu)")
    learning_rate: float = Field(1e-5, gt=0)
    lr_scheduler_type: Literal["cosine", "constant", "linear"] = "cosine"
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0)
    optim: Literal["adamw_torch", "adamw_8bit"] = Field("adamw_torch", description="AdamW in torch, or "
                                                        "bitsandbytes' 8-bit AdamW (qerl.optim)")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    beta: float = Field(0.0, ge=0.0, description="k3 KL coefficient against the base (adapter disabled)")
    epsilon: float = Field(0.2, gt=0)
    epsilon_high: float = Field(0.28, gt=0)
    mask_truncated_completions: bool = False
    max_prompt_length: int = Field(512, ge=8)
    max_completion_length: int = Field(1024, ge=1)
    logprob_chunk_size: int = Field(256, ge=16, description="tokens per lm_head chunk (no B*T*V logits)")
    gradient_checkpointing: bool = False
    offload_activations: bool = Field(False, description="keep tensors saved for backward (with gradient "
                                      "checkpointing: each layer's input) in pinned CPU memory")
    mlp_chunks: int = Field(1, ge=1, le=64, description="token slices of each decoder MLP in training (qerl."
                            "tiled_mlp): backward holds one slice's intermediate-size tensors at a time, for one "
                            "more MLP forward per update")
    fused_elementwise: bool = Field(True, description="on CUDA, RMSNorm, the MLP's SiLU(gate) * up and the "
                                    "lm_head chunks' log-probs of the training forward and backward as "
                                    "torch.compile'd kernels (qerl.fused_elementwise); false: eager ops")
    cudnn_attention: bool = Field(False, description="cuDNN SDPA in padded training forwards (a graph per length)")
    padding_free: bool | Literal["auto", "shared_prompts"] = Field(
        "auto", description="packed update rows (qerl.packing); auto, shared_prompts: each prompt once per group")
    dense_weights: bool | Literal["auto"] = Field("auto", description="the update's GEMMs over per-update dense "
                                                  "copies of the FP4 base (qerl.update_copies); auto: where they fit")
    mixed_precision: Literal["auto", "off"] = Field(
        "auto", description="auto: a bf16/fp16 model with fp32 trainable parameters (peft adapters) runs its training "
        "forward under torch.autocast in its dtype (LoRA matmuls in bf16 as the rollout's and TRL's bf16=True; fp32 "
        "master weights and AdamW); off: peft casts each LoRA input to fp32 (a saved fp32 copy per LoRA layer)")
    train_norms: bool = Field(False, description="also train RMSNorm scales (the original scripts do)")
    rollout_correction: Literal["none", "tis"] = "none"
    tis_cap: float = Field(2.0, gt=1.0)
    quant_kl_steps: int = Field(0, ge=0, description="every N steps, quant/kl: KL from the quantized policy to the "
                                "dense base with the same adapter, on that step's rollouts (holds a 2nd model); 0: off")
    quant_kl_model: str | None = Field(None, description="dense base of quant_kl_steps; None: the experiment's model")
    aqn: AQNConfig | None = Field(default_factory=AQNConfig, description="null disables noise")
    lora: LoraSection = Field(default_factory=LoraSection)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    save_steps: int = Field(50, ge=1, description="checkpoint every N steps (and at the last)")
    logging_steps: int = Field(1, ge=1, description="MLflow gets each metric's mean over every N steps (TRL's "
                               "logging_steps); metrics.csv keeps every step")
    grading_timeout_s: float = Field(1.0, gt=0, le=60, description="wall-time limit of one completion's reward "
                                     "(extraction + math-verify); over it: reward 0, in rewards/grading_timeouts")
    num_gpus: int = Field(1, ge=1, le=8, description="data-parallel ranks on the GPUs of one node (qerl."
                          "distributed): each rolls out and trains on batch_size / num_gpus prompts per step, "
                          "same result as one; > 1 runs under torchrun")
    num_nodes: int = Field(1, ge=1, le=64, description="nodes of num_gpus ranks, a torchrun on each (qerl.launch)")
    seed: int = 0

    @model_validator(mode="after")
    def _cross_checks(self):
        for name in self.rewards:
            _check_reward_name(name)
        if self.epsilon_high < self.epsilon:
            raise ValueError("epsilon_high must be >= epsilon")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError("reward_weights needs one weight per entry of rewards")
        if (self.batch_size * self.num_generations) % self.micro_batch_size:
            raise ValueError("micro_batch_size must divide batch_size * num_generations")
        if self.padding_free == "shared_prompts" and self.micro_batch_size % self.num_generations:
            raise ValueError("padding_free shared_prompts needs micro_batch_size a multiple of num_generations")
        ranks, nodes = self.num_nodes * self.num_gpus, "num_nodes x " * (self.num_nodes > 1)
        if self.batch_size % ranks:
            raise ValueError(f"{nodes}num_gpus ({ranks}) must divide batch_size ({self.batch_size}): each rank "
                             "takes whole prompt groups")
        if (self.batch_size * self.num_generations // ranks) % self.micro_batch_size:
            raise ValueError(f"micro_batch_size must divide batch_size * num_generations / {nodes}num_gpus (the "
                             "rows of one rank)")
        if ranks > 1 and self.rollout.engine == "vllm":  # vLLM would join torchrun's world itself
            raise ValueError("num_gpus > 1 needs rollout.engine torch or paged: a vLLM engine per torchrun rank is "
                             "not wired (it needs vLLM's external_launcher backend)")
        if self.rollout.weights == "nvfp4" and (self.mode != "full" or ranks == 1):
            raise ValueError("rollout.weights nvfp4 is for mode full on several GPUs (FSDP2's rollout copy)")
        if self.rollout.weights == "nvfp4" and self.rollout_correction != "tis":
            raise ValueError("rollout.weights nvfp4 needs rollout_correction: tis (4-bit rollouts, bf16 updates)")
        return self


class BenchmarkEntry(_Section):
    name: str = Field(..., description="gsm8k, math500, aime24, aime25, amc23, demo")
    source: str | None = Field(None, description="local file or hub name overriding the registry")
    k: int | None = Field(None, ge=1, description="samples per problem for pass@1 (None: registry default)")

    @model_validator(mode="after")
    def _known(self):
        from qerl.benchmarks import BENCHMARKS

        if self.name not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {self.name!r} (have: {', '.join(BENCHMARKS)})")
        return self


class EvalConfig(_Section):
    benchmarks: list[BenchmarkEntry]
    data_dir: str | None = Field(None, description="folder with <benchmark>/test.jsonl; None: hub names")
    variants: list[Literal["trained", "base", "quantized_base"]] = ["trained", "base"]
    greedy: bool = True
    sampled: bool = True
    temperature: float = Field(0.6, gt=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    max_new_tokens: int = Field(4096, ge=1)
    stop: list[StopString] = Field([], description="stop strings (use the training rollout's, e.g. the demo's newline)")
    template: str | None = Field(None, description="None: the training template")
    batch_size: int = Field(64, ge=1, description="prompts per generate call")
    limit: int | None = Field(None, ge=1, description="evaluate only the first N problems (smoke tests)")
    engine: Literal["torch", "paged", "vllm"] = "torch"
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    grading_timeout_s: float = Field(1.0, gt=0, le=60, description="wall-time limit of grading one sample; a "
                                     "sample over it counts as wrong and in the benchmark's grading_timeouts")
    seed: int = 0


class MergeConfig(_Section):
    requantize: QuantScheme | None = Field(None, description="re-quantize the merged model for 4-bit serving")


class ExperimentConfig(_Section):
    model: ModelRef = Field(..., min_length=1, description="hub name, local directory, or resources/<name> built "
                            "by a rule")
    model_revision: Revision | None = Field(None, min_length=1, description="hub branch, tag or commit of `model` "
                                            "(None: main); ignored for local directories")
    row: str | None = Field(None, description="row key in the paper's tables, e.g. 'nvfp4_lora_aqn'")
    model_size: str | None = Field(None, description="e.g. 7B; selects the table column and resources")
    quantize: QuantizeConfig = Field(default_factory=QuantizeConfig)
    train: TrainConfig
    merge: MergeConfig = Field(default_factory=MergeConfig)
    eval: EvalConfig

    @model_validator(mode="after")
    def _mode_needs_scheme(self):
        if self.model_revision and (self.model.startswith(("/", ".", "~", "resources/")) or Path(self.model).exists()):
            raise ValueError(f"model_revision is for hub names; {self.model!r} is a local path")
        fp4 = self.quantize.scheme in ("nvfp4", "nvfp4-awq", "mxfp4")
        if self.train.mode == "qlora_fp4" and not fp4:
            raise ValueError("train.mode qlora_fp4 needs quantize.scheme nvfp4, nvfp4-awq or mxfp4")
        if self.train.mode == "qlora_nf4" and self.quantize.scheme != "nf4":
            raise ValueError("train.mode qlora_nf4 needs quantize.scheme nf4")
        if self.train.quant_kl_steps and self.train.quant_kl_model is None and not self.model_revision:
            self.train.quant_kl_model = self.model  # the dense original the quantize stage started from
        from qerl.memory import check_fits

        try:
            check_fits(self.model_size, self.quantize.scheme, self.train)
        except ValueError as err:
            raise ValueError(f"train.num_gpus: {err}") from None
        return self


class MlflowConfig(_Section):
    tracking_uri: str | None = Field(None, min_length=1, description="None: sqlite:///<results_dir>/mlflow.db; "
                                     "the environment's MLFLOW_TRACKING_URI wins")
    experiment_name: str = Field("qerl", min_length=1, description="MLflow experiment of every stage's run")

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, uri: str | None) -> str | None:
        # the URI is a word of every job's command line, which Snakemake prints and logs
        if uri and "@" in uri.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError("holds credentials; put them in MLFLOW_TRACKING_USERNAME/PASSWORD (or the "
                             "MLFLOW_TRACKING_URI environment variable), not in the config")
        return uri


class AblationMethod(_Section):
    label: str = Field(..., min_length=1, description="legend and table label, e.g. 'NVFP4 LoRA + AQN'")
    quantize: dict[str, Any] = Field({}, description="keys of the base experiment's quantize section to change")
    train: dict[str, Any] = Field({}, description="keys of the base experiment's train section to change")


class AblationConfig(_Section):
    base: str = Field(..., description="experiment whose model, data, recipe and eval every run starts from")
    seeds: list[int] = Field([0, 1, 2], min_length=1, description="train.seed of each run of every method")
    methods: dict[MethodName, AblationMethod] = Field(..., min_length=1, description="name -> what it changes")
    train: dict[str, Any] = Field({}, description="train keys changed for every run (e.g. a shorter run)")
    eval: dict[str, Any] = Field({}, description="eval keys changed for every run (e.g. limit)")
    smooth_steps: int = Field(5, ge=1, description="moving-average window of the plotted curves, in steps")


class Config(_Section):
    default_target: str = Field("demo", description="experiment built by `snakemake` with no target")
    results_dir: ResultsDir = "results"
    python: str | None = Field(None, description="interpreter for the stages; None: the one running snakemake")
    vllm_python: str | None = Field(None, description="interpreter of the vLLM environment (engine: vllm)")
    tokenizer_dir: str = Field("../shared/tokenizers/qwen2.5", description="tokenizer of resources/tiny-qwen2")
    data_dir: str = Field("../shared/data", description="local benchmark files (<name>/test.jsonl)")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    experiments: dict[str, ExperimentConfig]
    ablations: dict[str, AblationConfig] = Field({}, description="name -> methods x seeds of one base experiment "
                                                 "(qerl.ablation); `snakemake <name>` runs and renders it")

    @field_validator("experiments")
    @classmethod
    def _safe_names(cls, experiments):
        from qerl.paths import RESERVED_NAMES

        for name in experiments:
            if not EXPERIMENT_NAME.match(name):
                raise ValueError(f"experiment name {name!r} must match {EXPERIMENT_NAME.pattern} (it becomes "
                                 "a directory under results/ and a word on the command line)")
            if name in RESERVED_NAMES:
                raise ValueError(f"experiment name {name!r} is taken by results/{name}/ (reserved: "
                                 f"{', '.join(sorted(RESERVED_NAMES))})")
        return experiments

    @model_validator(mode="after")
    def _default_exists(self):
        if self.default_target not in self.experiments:
            raise ValueError(f"default_target '{self.default_target}' is not an experiment")
        for name, ablation in self.ablations.items():
            if not name.isidentifier() or ablation.base not in self.experiments:
                raise ValueError(f"ablations.{name}: the name must be an identifier (it is a Snakemake target) "
                                 f"and base '{ablation.base}' an experiment")
        return self


STAGE_MODELS: dict[str, type[BaseModel]] = {"quantize": QuantizeConfig, "train": TrainConfig, "merge": MergeConfig,
                                            "eval": EvalConfig}


def _one_line(err: ValidationError, where: str) -> str:
    e = err.errors()[0]
    path = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-") and p != "[key]")
    msg = " ".join(e["msg"].replace("Value error, ", "").split())
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{where}: {path or '<root>'}: {'unknown key' if e['type'] == 'extra_forbidden' else msg}{more}"


def optimizer_problem(optim: str) -> str | None:
    """Why train.optim cannot be built in this environment (a missing package), or None."""
    if optim == "adamw_8bit" and importlib.util.find_spec("bitsandbytes") is None:
        return "adamw_8bit needs bitsandbytes, not installed (pip install 'qerl[gpu]', or optim: adamw_torch)"
    return None


def check_environment(cfg: Config, where: str) -> None:
    """What a valid config needs installed here (`check`; the trainer raises the same line building its optimizer);
    kept out of parsing, so a GPU-only package missing here does not block the CPU demo."""
    for name, exp in cfg.experiments.items():
        for key, problem in (("optim", optimizer_problem(exp.train.optim)),
                             ("num_nodes", nodes_problem(exp.train.num_nodes))):
            if problem:
                raise QerlError(f"{where}: experiments.{name}.train.{key}: {problem}")


def parse_config(data: dict[str, Any], where: str = "config") -> Config:
    """Validate a whole config mapping; raise QerlError naming the first bad key."""
    data = {k: v for k, v in data.items() if not str(k).startswith("_")}  # _name: YAML anchor holders
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise QerlError(_one_line(err, where)) from None


def parse_section(kind: str, data: dict[str, Any] | str, where: str = "stage config") -> BaseModel:
    """Validate one stage's section (what a rule passes as --config-json)."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as err:
            raise QerlError(f"{where}: not valid JSON ({err.msg} at char {err.pos})") from None
    try:
        return STAGE_MODELS[kind].model_validate(data)
    except ValidationError as err:
        raise QerlError(_one_line(err, f"{where} [{kind}]")) from None


def load_config(path: str | Path) -> Config:
    """Read (qerl.config_input: bounded aliases, no duplicate keys, line:column errors) and validate a config file."""
    path = Path(path)
    if not path.is_file():
        raise QerlError(f"config file not found: {path}")
    data = load_yaml_file(path) or {}
    if not isinstance(data, dict):
        raise QerlError(f"{path}: expected a mapping of keys at the top, got {type(data).__name__}")
    return parse_config(data, where=str(path))


def section_json(exp: ExperimentConfig, kind: str) -> str:
    """The JSON a rule passes to a stage CLI: only that stage's section, so other edits don't rerun it."""
    section = exp.eval if kind == "eval" else getattr(exp, kind)
    return json.dumps(section.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def json_schema() -> dict[str, Any]:
    return {**Config.model_json_schema(), "$schema": "https://json-schema.org/draft/2020-12/schema",
            "patternProperties": {"^_": {}},  # top-level _name keys only hold YAML anchors
            "description": "qerl experiment config (generated by `python -m qerl.config schema`)"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m qerl.config", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("schema", help="print the JSON Schema as YAML")
    sub.add_parser("check", help="validate a config file").add_argument("path")
    sub.add_parser("memory", help="estimated GPU memory per rank of each experiment, GPUs needed").add_argument("path")
    a = p.parse_args(argv)
    if a.cmd == "schema":
        return yaml.safe_dump(json_schema(), sys.stdout, sort_keys=False)
    try:
        cfg = load_config(a.path)
        if a.cmd == "check":
            check_environment(cfg, a.path)
    except QerlError as err:
        sys.exit(f"error: {err}")
    if a.cmd == "memory":
        from qerl.memory import report_header, report_line
        lines = (report_line(n, e.model_size, e.quantize.scheme, e.train) for n, e in cfg.experiments.items())
        print("\n".join([report_header(), *(line for line in lines if line)]))
        return
    print(f"ok: {len(cfg.experiments)} experiments")


if __name__ == "__main__":
    main()
