"""LoRA's B product at inference (qerl.quant.dispatch.lora_expand, kernels.lora_expand): base (+ bias) + scale *
xa @ B.T per stacked member, against float64; torch's path on CPU, the Triton kernel through its interpreter
(float32: the interpreter's bf16 dot is not exact) and on a GPU in bf16 (marked gpu), eager and in a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from qerl.errors import QerlError
from qerl.quant.dispatch import lora_expand, run_lora_expand
from qerl.quant.grouped import block_diagonal
from tests.rollout.interpreted import run_interpreted

CASES = [  # rows, member sizes along N, r, bias
    (1, [64], 8, False),
    (5, [48, 16, 16], 8, True),
    (33, [96, 32], 16, True),
    (130, [80, 48, 32], 32, False),
]


def operands(m, sizes, r, bias, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype=dtype, device=device)  # noqa: E731
    return make(m, n), make(m, len(sizes) * r), make(n, r), (make(n) if bias else None)


def reference(base, xa, b, scale, sizes, bias):
    out = base.double() + (0 if bias is None else bias.double())
    r, lo = b.shape[1], 0
    for i, size in enumerate(sizes):
        out[:, lo:lo + size] += scale * xa[:, i * r:(i + 1) * r].double() @ b[lo:lo + size].double().T
        lo += size
    return out


@pytest.mark.parametrize("m,sizes,r,bias", CASES)
@pytest.mark.parametrize("diag", [False, True])
def test_torch_path_matches_float64(m, sizes, r, bias, diag):
    base, xa, b, bi = operands(m, sizes, r, bias, torch.float32)
    want = reference(base, xa, b, 0.75, sizes, bi)
    got = lora_expand(base, xa, b, 0.75, sizes, bi, block_diagonal(b, sizes) if diag else None)
    assert torch.allclose(got.double(), want, atol=1e-4)
    assert not torch.equal(got.double(), base.double())  # the product is not vanishing


def test_in_place_writes_base_and_a_new_output_leaves_it():
    base, xa, b, bias = operands(9, [32, 16], 4, True, torch.float32)
    keep = base.clone()
    new = lora_expand(base, xa, b, 2.0, [32, 16], bias)
    assert torch.equal(base, keep)
    n1 = 32
    same = run_lora_expand(base, xa, b, 2.0, n1, 48, bias, out=base)
    assert same is base and torch.allclose(base, new, atol=1e-5)


def test_bad_shapes_are_one_line():
    from qerl.quant.kernels.lora_expand import lora_expand as kernel

    base, xa, b, _ = operands(4, [32, 32], 8, False, torch.float32)
    with pytest.raises(QerlError, match="lora_expand: .* do not fit"):
        kernel(base, xa[:, :8], b, 1.0, 32, 64)  # two members need 2 x r columns of xa


INTERPRETED = """
from tests.quant.test_lora_expand import CASES, operands, reference
from qerl.quant.kernels.lora_expand import lora_expand
errors = []
for m, sizes, r, bias in CASES:
    base, xa, b, bi = operands(m, sizes, r, bias, torch.float32)
    n = sum(sizes)
    bounds = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)] + [n, n]
    want = reference(base, xa, b, 0.5, sizes, bi)
    errors.append(float((lora_expand(base, xa, b, 0.5, bounds[0], bounds[1], bi).double() - want).abs().max()))
    lora_expand(base, xa, b, 0.5, bounds[0], bounds[1], bi, out=base)  # in place
    errors.append(float((base.double() - want).abs().max()))
print(json.dumps(errors))
"""


def test_interpreted_kernel_matches_float64():
    errors = run_interpreted(INTERPRETED)
    assert len(errors) == 2 * len(CASES) and max(errors) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 17, 48, 96, 128, 300, 512])
def test_gpu_kernel_in_bf16_eager_and_replayed(m):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from qerl.quant.dispatch import choose_kernel

    sizes, r = [3584, 512, 512], 32  # a 7B q|k|v with LoRA r 32
    assert choose_kernel("expand", "cuda", (9, 0), m, n=3 * r) == "triton"
    base, xa, b, bias = operands(m, sizes, r, True, torch.bfloat16, "cuda", seed=m)
    want = reference(base, xa, b, 2.0, sizes, bias)
    tol = 2e-2 * want.abs().max().item()  # one bf16 rounding of the output
    got = lora_expand(base, xa, b, 2.0, sizes, bias)
    assert (got.double() - want).abs().max().item() < tol
    out = torch.empty_like(base)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(lora_expand(base, xa, b, 2.0, sizes, bias))
    b.mul_(-1)  # an adapter refresh in place: the replay reads the new B
    graph.replay()
    want = reference(base, xa, b, 2.0, sizes, bias)
    assert (out.double() - want).abs().max().item() < tol
