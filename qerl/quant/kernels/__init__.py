"""The GPU kernels behind qerl.quant.dispatch, which alone decides which of them runs (dispatch.choose_kernel).

    triton_fp4.py      fused Triton W4A16 kernels (few and mid rows, grad_input) and small_matmul (x @ A.T)
    triton_dequant.py  many rows: chunked dequantize (Triton) + cuBLAS
    cuda_fp4.py        hand-written CUDA forward for few rows (its C source: fp4_gemv.cu), built by cuda_build.py
    _e2m1.py           the one E2M1 -> bf16 PTX decode that both the Triton and the CUDA kernels use
    tiling.py          tile and split-K rules (no triton: testable on CPU)
    device.py          compute capability and QERL_PDL, read at launch

Nothing here imports from above this folder (tests/test_import_graph.py checks it), and this file imports nothing,
so `import qerl.quant.kernels.tiling` needs no triton.
"""
