"""bench.wired: the stacked decode layer's table (the timing itself needs a GPU)."""
from __future__ import annotations

import pytest
import torch

from bench import wired


def test_wired_markdown_rows_and_layer_totals():
    def row(layer, n, k, scale):
        return {"model": "7B", "layer": layer, "N": n, "K": k, "M": 8, "floor_us": 1.0 * scale,
                "bf16_us": 10.0 * scale, "triton_us": 5.0 * scale, "chosen_us": 4.0 * scale, "chosen": [1, 8],
                "best_us": 3.0 * scale, "best": [2, 4], "lora_triton_us": 6.0 * scale, "lora_cuda_us": 4.5 * scale}

    lines = wired.wired_markdown({"rows": [row("q|k|v", 4608, 3584, 1), row("down", 3584, 18944, 3)]})
    lines = lines.splitlines()
    assert lines[2] == ("| 7B | q\\|k\\|v | 4608 x 3584 | 8 | 1.0 | 10.0 | 5.0 | 4.0 (1, 8) | 3.0 (2, 4) | 1.25x | "
                        "2.50x | 6.0 | 4.5 |")
    assert lines[4] == "| 7B | **layer** | | 8 | 4.0 | 40.0 | 20.0 | 16.0 | 12.0 | 1.25x | 2.50x | 24.0 | 18.0 |"


def test_layer_shapes_stack_to_their_segments():
    for shapes in wired.LAYER_SHAPES.values():
        for _, n, _, segments in shapes:
            assert sum(segments) == n


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
def test_without_a_gpu_the_cli_says_so():
    with pytest.raises(SystemExit, match="bench.wired needs a CUDA GPU"):
        wired.main(["--rows", "1"])
