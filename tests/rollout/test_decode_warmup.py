"""A decode step's eager warm-up launches its kernels as the capture after it does (kernels.device.
decode_step_launches): PDL there too under QERL_PDL=auto, so the capture replays the kernels the warm-up compiled
instead of compiling a second, PDL-launched set (launch_pdl is a Triton compile option)."""
from __future__ import annotations

import pytest
import torch

from qerl.quant.kernels import device


def test_decode_step_launches_turn_pdl_on_for_eager_launches_on_hopper_only_under_auto(monkeypatch):
    monkeypatch.setattr(device, "hopper", lambda index: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.delenv("QERL_PDL", raising=False)
    assert not device.use_pdl(0)  # an eager launch outside a decode step: no PDL
    with device.decode_step_launches():
        assert device.use_pdl(0)
        with device.decode_step_launches():
            assert device.use_pdl(0)
        assert device.use_pdl(0)  # the inner exit restores the outer state
    assert not device.use_pdl(0)
    monkeypatch.setenv("QERL_PDL", "0")
    with device.decode_step_launches():
        assert not device.use_pdl(0)  # the switch still wins
    monkeypatch.setenv("QERL_PDL", "auto")
    monkeypatch.setattr(device, "hopper", lambda index: False)
    with device.decode_step_launches():
        assert not device.use_pdl(0)  # no griddepcontrol before sm_90
    monkeypatch.setattr(device, "hopper", lambda index: True)
    with pytest.raises(RuntimeError), device.decode_step_launches():
        raise RuntimeError("a failing step")
    assert not device.use_pdl(0)  # reset on an error too


@pytest.mark.gpu
def test_gpu_captures_compile_none_of_our_triton_kernels():
    """bf16 FP4 + LoRA on the paged engine with graphs: every Triton kernel a captured step runs was compiled by
    its eager warm-up (before: each PDL-launched kernel was compiled again inside the capture)."""
    from qerl import compile_cache
    from qerl.rollout import SamplingParams
    from qerl.rollout.paged_engine import PagedEngine
    from qerl.rollout.paged_graphs import DecodeGraphs
    from tests.rollout.conftest import random_fp4_lora

    model, tok, prompts = random_fp4_lora()
    model = model.to(torch.bfloat16).cuda()
    assert compile_cache.install_triton_clock()
    during, capture = [], DecodeGraphs._capture

    def counted(self, size):
        before = compile_cache.TRITON_JIT["kernels"]
        try:
            return capture(self, size)
        finally:
            during.append(compile_cache.TRITON_JIT["kernels"] - before)

    DecodeGraphs._capture = counted
    try:
        clock = compile_cache.CompileClock()
        engine = PagedEngine(model, tok, block_size=16, num_blocks=128, eos_token_ids=(), compile=False)
        out = engine.generate(prompts * 6, 2, SamplingParams(temperature=0, max_tokens=6))  # 36 rows
    finally:
        DecodeGraphs._capture = capture
    assert out.stats["graph_captures"] >= 1 and len(during) == out.stats["graph_captures"]
    print(f"our Triton kernels compiled by the call: {clock.summary()['triton_kernels']}, in captures: {during}")
    assert during == [0] * len(during), during
