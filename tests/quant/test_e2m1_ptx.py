"""The FP4 kernels' inline PTX decode (qerl.quant.kernels._e2m1), run through a small emulator of the PTX it uses.

The emulator follows the PTX ISA for each instruction (prmt's default mode with msb replication, funnel shift,
bf16x2 fma with round-to-nearest-even and subnormals); the expected values come from compressed-tensors' own
NVFP4 table (via qerl.quant.format's float reference), so a wrong selector, shift or mask fails here without a GPU.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from qerl.quant.kernels import _e2m1 as ptx
from qerl.quant.format import dequantize_nvfp4

M32 = 0xFFFFFFFF


def _prmt(a: int, b: int, c: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for k in range(4):
        f = (c >> (4 * k)) & 0xF
        byte = src[f & 7]
        if f & 8:  # replicate the selected byte's msb
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * k)
    return out


def _bf16_halves(v: int) -> torch.Tensor:
    return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _fma_bf16x2(a: int, b: int, c: int) -> int:
    # exact in float64 (bf16 x bf16 has <= 16 significant bits), then one rounding to bf16: fma.rn semantics
    r = (_bf16_halves(a).double() * _bf16_halves(b).double() + _bf16_halves(c).double()).to(torch.bfloat16)
    lo, hi = (int(h) & 0xFFFF for h in r.view(torch.int16))
    return lo | (hi << 16)


def run_ptx(text: str, operands: list[int]) -> list[int]:
    """Execute the asm block with $0.. bound to `operands` (outputs first); returns the final operand values."""
    regs: dict[str, int] = {f"${i}": v for i, v in enumerate(operands)}

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 16) if tok.lower().startswith("0x") else (int(tok) if tok.isdigit() else regs[tok])

    for line in text.strip().splitlines():
        line = line.strip().rstrip(";")
        if line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [t.strip() for t in args.split(",")]
        x = [val(t) for t in src]
        if op == "mov.b32":
            r = x[0]
        elif op == "shf.l.wrap.b32":
            n = x[2] & 31
            r = (((x[1] << 32) | x[0]) << n >> 32) & M32
        elif op == "prmt.b32":
            r = _prmt(*x)
        elif op == "shl.b32":
            r = (x[0] << x[1]) & M32
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "fma.rn.bf16x2":
            r = _fma_bf16x2(*x)
        else:
            raise AssertionError(f"emulator has no {op}: extend it along with the PTX")
        regs[d] = r
    return [regs[f"${i}"] for i in range(len(operands))]


def _scale_operand(scale_f8: torch.Tensor) -> int:
    """What the kernel passes as $5..$8: bf16(scale * SCALE_UP) in both halves."""
    s = (scale_f8.double() * ptx.SCALE_UP).to(torch.bfloat16)
    assert s.double() == scale_f8.double() * ptx.SCALE_UP, "scale * SCALE_UP must be exact in bf16"
    bits = int(s.view(torch.int16)) & 0xFFFF
    return bits | (bits << 16)


def _decode(word: int, scale_f8: torch.Tensor) -> torch.Tensor:
    """8 weights of one packed word through the PTX, as float64 values times DEQ_GAIN (i.e. e2m1 * scale)."""
    s = _scale_operand(scale_f8)
    outs = run_ptx(ptx.E2M1_BF16, [0, 0, 0, 0, word, s, s, s, s])[:4]
    vals = torch.cat([_bf16_halves(o).double() for o in outs])  # order: weight 0, 1, ..., 7
    return vals * ptx.DEQ_GAIN


def _reference(words: list[int], scale_f8: torch.Tensor) -> torch.Tensor:
    packed = torch.tensor([[(w >> (8 * j)) & 0xFF for w in words for j in range(4)]], dtype=torch.uint8)
    n = packed.shape[1] * 2
    scales = scale_f8.reshape(1, 1).expand(1, n // 16).contiguous().to(torch.float8_e4m3fn)
    return dequantize_nvfp4(packed, scales, torch.ones(1), torch.float64).reshape(-1)


def test_every_nibble_in_every_position():
    # 16 codes in each of the 8 positions: words whose nibbles run through all codes, shifted per position
    scale = torch.tensor(1.0).to(torch.float8_e4m3fn)
    words = []
    for start in range(16):
        words.append(sum(((start + p) % 16) << (4 * p) for p in range(8)))
    words += [0, M32, 0x88888888, 0x77777777, 0x01234567, 0x89ABCDEF]
    words += [w ^ 0x8 for w in words[:4]]  # odd word counts
    words = words[: len(words) // 2 * 2]  # two words = one group of 16
    got = torch.cat([_decode(w, scale.float()) for w in words])
    torch.testing.assert_close(got, _reference(words, scale.float()), rtol=0, atol=0)


def test_every_fp8_scale_exact():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)]
    word = 0xF7E6D5C4  # codes 4..7 and 12..15: +-2, 3, 4, 6 (the largest magnitudes)
    small = 0x91A08119  # +-0.5, +-0, +-0.5, 1, -1: the e2m1 subnormals and zero
    for s in codes:
        for w in (word, small):
            torch.testing.assert_close(_decode(w, s), _reference([w, w], s)[:8], rtol=0, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_words_and_scales(seed):
    rng = np.random.default_rng(seed)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[torch.isfinite(codes.float())].float()
    for _ in range(64):
        w = [int(v) for v in rng.integers(0, 2**32, 2, dtype=np.uint64)]
        s = codes[int(rng.integers(0, len(codes)))]
        got = torch.cat([_decode(v, s) for v in w])
        torch.testing.assert_close(got, _reference(w, s), rtol=0, atol=0)


def test_emulator_reads_every_instruction():
    ops = {ln.strip().split()[0] for ln in ptx.E2M1_BF16.strip().splitlines() if re.match(r"\s*[a-z]", ln)}
    assert ops <= {"mov.b32", "shf.l.wrap.b32", "prmt.b32", "shl.b32", "and.b32", "fma.rn.bf16x2"}, ops
