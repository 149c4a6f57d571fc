"""The PTX that turns packed NVFP4 weights into bf16 tensor-core operands: the one source of the E2M1 decode of both
the Triton kernels (kernels.triton_fp4 inlines E2M1_BF16) and the CUDA kernel (cuda_decode8 wraps the same text).

Kept free of triton so the CPU test suite can check it instruction by instruction (tests/quant/test_e2m1_ptx.py).
"""
from __future__ import annotations

# E2M1 -> bf16 by moving bits, no lookup table: the nibble's 3 magnitude bits (e1 e0 m) go to bf16 bits 8..6 (the two
# low exponent bits and the top mantissa bit) and its sign to bit 15. That bf16 is exactly e2m1 * 2^-126 (e = 0 lands
# on the bf16 subnormals m * 2^-127), so multiplying by the group scale pre-multiplied by 2^119 (exact in bf16 for
# every FP8 E4M3 value, at most 1.75 * 2^127) gives e2m1 * scale * 2^-7, exact: every such product is a multiple of
# 2^-17 with at most 6 significant bits, at most 21. The 2^7 goes back into the fp32 accumulator with the global
# scale (DEQ_GAIN). One call: 4 packed bytes ($4) -> 4 registers, register j = [bf16(low nibble of byte j),
# bf16(high nibble)] (the two consecutive-k weights of byte j, in the order the tensor-core operand wants), times
# the scale pair $5..$8. r = rotl(w, 4) puts each high nibble in the low half of the next byte and each low nibble's
# sign bit on its byte's msb; prmt (selector nibble bit 3 = replicate the byte's msb) builds
# x = [w byte j, sign(low nibble) x8, r byte j+1, sign(high nibble) x8], and (x << 6) & 0x81C081C0 is the pair
# of bf16 patterns: 3 instructions per 2 weights + the scale multiply (fma with -0: mul.bf16x2 needs sm_90,
# fma.bf16x2 runs from sm_80; ptxas emits HMUL2). tests/quant/test_e2m1_ptx.py runs
# this text through a small PTX emulator on every nibble and every FP8 scale (no GPU needed).
E2M1_BF16 = """
{
.reg .b32 r, x0, x1, x2, x3, nz;
mov.b32 nz, 0x80008000;
shf.l.wrap.b32 r, $4, $4, 4;
prmt.b32 x0, r, $4, 0xC184;
prmt.b32 x1, r, $4, 0xD295;
prmt.b32 x2, r, $4, 0xE3A6;
prmt.b32 x3, r, $4, 0xF0B7;
shl.b32 x0, x0, 6;
shl.b32 x1, x1, 6;
shl.b32 x2, x2, 6;
shl.b32 x3, x3, 6;
and.b32 x0, x0, 0x81C081C0;
and.b32 x1, x1, 0x81C081C0;
and.b32 x2, x2, 0x81C081C0;
and.b32 x3, x3, 0x81C081C0;
fma.rn.bf16x2 $0, x0, $5, nz;
fma.rn.bf16x2 $1, x1, $6, nz;
fma.rn.bf16x2 $2, x2, $7, nz;
fma.rn.bf16x2 $3, x3, $8, nz;
}
"""

# The decode returns e2m1 * scale / DEQ_GAIN; kernels multiply their fp32 sums by DEQ_GAIN / global_scale.
DEQ_GAIN = 128.0
SCALE_UP = 2.0 ** 119  # the group scale's factor before the multiply: SCALE_UP * 2^-126 = 1 / DEQ_GAIN


def cuda_decode8() -> str:
    """decode8(w, s2, o0..o3): E2M1_BF16 as a CUDA asm block, one scale pair s2 for all four output registers;
    kernels.cuda_fp4 puts it into fp4_gemv.cu in place of the line `// QERL_DECODE8`."""
    text = E2M1_BF16.strip()
    for j in (6, 7, 8):
        text = text.replace(f"${j}", "$5")
    lines = "".join(f'      "{line}\\n"\n' for line in text.replace("$", "%").splitlines())
    return ("__device__ __forceinline__ void decode8(uint32_t w, uint32_t s2, uint32_t &o0, uint32_t &o1,\n"
            "                                        uint32_t &o2, uint32_t &o3) {\n  asm(\n" + lines
            + '      : "=r"(o0), "=r"(o1), "=r"(o2), "=r"(o3)\n      : "r"(w), "r"(s2));\n}\n')
