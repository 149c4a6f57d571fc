"""The QeRL paper's reported numbers, for side-by-side tables. Nothing here is measured by us.

Source: Huang et al., "QeRL: Beyond Efficiency -- Quantization-enhanced Reinforcement Learning for LLMs",
arXiv:2510.11696v1 (13 Oct 2025): Table 1 (GSM8K, GRPO, Qwen2.5-3B/7B-Instruct), Table 2 (MATH 500 / AIME 24 /
AIME 25 / AMC 23, DAPO on BigMath, Qwen2.5-7B/14B/32B-Instruct), Table 3 (model size and end-to-end speedup,
7B/14B) and appendix Tables 5-8 (rollout throughput at batch 2 and 8, model sizes for 3B and 32B).
Accuracies are percentages (pass@1, temperature 0.6, top-p 0.95, 4096 completion tokens). A value the paper does
not report is None, never a guess.
"""
from __future__ import annotations

SOURCE = "arXiv:2510.11696v1, Tables 1-3 and 5-8"

# Row keys shared with qerl.tables: "<format>" = quantized (or bf16) base without training,
# "<format>_<training>" = trained. "aqn" suffix = with Adaptive Quantization Noise.
ROW_LABELS: dict[str, tuple[str, str]] = {  # row key -> (W#, Training) as the paper prints them
    "bf16": ("BF16", "-"),
    "nf4": ("NF4", "-"),
    "mxfp4": ("MXFP4", "-"),
    "nvfp4": ("NVFP4", "-"),
    "bf16_full": ("BF16", "Full"),
    "bf16_lora": ("BF16", "LoRA"),
    "nf4_lora": ("NF4", "LoRA"),
    "mxfp4_lora": ("MXFP4", "LoRA"),
    "nvfp4_lora": ("NVFP4", "LoRA"),
    "nvfp4_lora_aqn": ("NVFP4", "LoRA + AQN"),
}
NO_TRAINING_ROWS = ("bf16", "nf4", "mxfp4", "nvfp4")

# Table 1: GSM8K accuracy (%), GRPO on GSM8K.
TABLE1_ROWS = ("bf16", "nf4", "mxfp4", "nvfp4", "bf16_full", "bf16_lora", "nf4_lora", "mxfp4_lora",
               "nvfp4_lora", "nvfp4_lora_aqn")
TABLE1_SIZES = ("3B", "7B")
TABLE1: dict[tuple[str, str], float | None] = {
    ("3B", "bf16"): 61.2, ("3B", "nf4"): 57.5, ("3B", "mxfp4"): 59.8, ("3B", "nvfp4"): 59.4,
    ("3B", "bf16_full"): 84.4, ("3B", "bf16_lora"): 76.1, ("3B", "nf4_lora"): 76.1, ("3B", "mxfp4_lora"): 73.4,
    ("3B", "nvfp4_lora"): 83.3, ("3B", "nvfp4_lora_aqn"): 83.7,
    ("7B", "bf16"): 76.3, ("7B", "nf4"): 70.5, ("7B", "mxfp4"): 71.3, ("7B", "nvfp4"): 73.4,
    ("7B", "bf16_full"): 91.2, ("7B", "bf16_lora"): 88.1, ("7B", "nf4_lora"): 85.0, ("7B", "mxfp4_lora"): 86.4,
    ("7B", "nvfp4_lora"): 88.5, ("7B", "nvfp4_lora_aqn"): 90.8,
}

# Table 2: accuracy (%) per benchmark and the paper's own average, DAPO on BigMath.
TABLE2_BENCHMARKS = ("math500", "aime24", "aime25", "amc23")
TABLE2_ROWS = ("bf16", "nvfp4", "bf16_full", "bf16_lora", "nvfp4_lora", "nvfp4_lora_aqn")
TABLE2_SIZES = ("7B", "14B", "32B")
_T2 = {  # (math500, aime24, aime25, amc23, average) exactly as printed
    ("7B", "bf16"): (74.8, 9.2, 6.6, 25.0, 28.9),
    ("7B", "nvfp4"): (73.7, 8.3, 3.3, 17.5, 25.7),
    ("7B", "bf16_full"): (77.4, 16.7, 10.0, 45.0, 37.3),
    ("7B", "bf16_lora"): (77.0, 13.3, 10.0, 42.5, 35.7),
    ("7B", "nvfp4_lora"): (76.8, 13.7, 10.0, 47.5, 37.0),
    ("7B", "nvfp4_lora_aqn"): (77.4, 15.5, 10.0, 42.5, 36.4),
    ("14B", "bf16"): (78.6, 11.3, 9.2, 45.0, 36.0),
    ("14B", "nvfp4"): (76.4, 11.2, 8.3, 40.0, 34.0),
    ("14B", "bf16_full"): (83.2, 20.0, 15.1, 55.0, 43.3),
    ("14B", "bf16_lora"): (81.0, 14.0, 13.3, 52.5, 40.2),
    ("14B", "nvfp4_lora"): (79.4, 16.7, 13.3, 52.5, 40.5),
    ("14B", "nvfp4_lora_aqn"): (80.2, 17.5, 12.6, 57.5, 42.0),
    ("32B", "bf16"): (81.4, 14.0, 10.8, 52.5, 39.7),
    ("32B", "nvfp4"): (80.6, 11.3, 10.0, 45.0, 36.7),
    ("32B", "bf16_full"): (84.0, 20.0, 23.3, 57.5, 46.2),
    ("32B", "bf16_lora"): (83.6, 16.7, 13.3, 55.0, 42.2),
    ("32B", "nvfp4_lora"): (81.6, 16.7, 15.0, 52.5, 41.4),
    ("32B", "nvfp4_lora_aqn"): (83.3, 16.7, 19.2, 63.3, 45.6),
}
TABLE2: dict[tuple[str, str], dict[str, float | None]] = {
    key: dict(zip(TABLE2_BENCHMARKS + ("average",), values)) for key, values in _T2.items()
}

# Table 3 (+ appendix Tables 5-8): per (size, method). method: lora = BF16 LoRA, qlora = NF4 QLoRA,
# qerl = NVFP4 LoRA. model_size_gb: weights on disk. rollout_tokens_per_s: vLLM rollout throughput at batch 2 / 8
# (256 input tokens, up to 2048 completion tokens; Tables 5-8 do not report QLoRA). e2e_speedup: end-to-end GRPO
# step speedup over BF16 LoRA at batch 2 / 4 / 8 (Table 3, first 30 steps; only 7B and 14B).
TABLE3_SIZES = ("3B", "7B", "14B", "32B")
TABLE3_METHODS = ("lora", "qlora", "qerl")
METHOD_LABELS = {"lora": ("LoRA", "BF16"), "qlora": ("QLoRA", "NF4"), "qerl": ("QeRL", "NVFP4")}
METHOD_ROW_KEYS = {"lora": "bf16_lora", "qlora": "nf4_lora", "qerl": "nvfp4_lora"}
BATCH_SIZES_ROLLOUT = (2, 8)
BATCH_SIZES_E2E = (2, 4, 8)


def _t3(size_gb, tps2=None, tps8=None, e2e=(None, None, None)):
    return {"model_size_gb": size_gb, "rollout_tokens_per_s": {2: tps2, 8: tps8},
            "e2e_speedup": dict(zip(BATCH_SIZES_E2E, e2e))}


TABLE3: dict[tuple[str, str], dict] = {
    ("3B", "lora"): _t3(6.2, 151.2, 2226.3),
    ("3B", "qlora"): _t3(None),
    ("3B", "qerl"): _t3(2.8, 157.0, 2271.4),
    ("7B", "lora"): _t3(15.2, 115.4, 1641.1, (1.0, 1.0, 1.0)),  # the baseline of the speedups
    ("7B", "qlora"): _t3(5.7, None, None, (0.8, 0.8, 0.7)),
    ("7B", "qerl"): _t3(5.9, 151.6, 2091.8, (1.5, 1.4, 1.2)),
    ("14B", "lora"): _t3(29.6, 65.4, 737.2, (1.0, 1.0, 1.0)),
    ("14B", "qlora"): _t3(10.2, None, None, (0.9, 0.7, 0.7)),
    ("14B", "qerl"): _t3(10.6, 95.3, 1091.1, (1.4, 1.2, 1.2)),
    ("32B", "lora"): _t3(62.3, 34.0, 344.3),
    ("32B", "qlora"): _t3(None),
    ("32B", "qerl"): _t3(20.7, 60.0, 688.2),
}


def table1_value(size: str, row: str) -> float | None:
    return TABLE1.get((size, row))


def table2_value(size: str, row: str, benchmark: str) -> float | None:
    return TABLE2.get((size, row), {}).get(benchmark)
