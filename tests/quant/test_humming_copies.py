"""qerl.quant.humming_copies on CPU: which matmuls get a copy and what they would cost (no GPU, no humming)."""
from __future__ import annotations

import torch

from bench.random_models import attach_lora, build_random_model, qwen25_config
from qerl.quant.grouped import group_projections
from qerl.quant.humming_copies import _operands, detach_humming_copies, humming_copy_bytes


def _model():
    config = qwen25_config("7B", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, pad_token_id=0, bos_token_id=0, eos_token_id=1)
    return attach_lora(build_random_model(config, fp4=True, device="cpu", dtype=torch.float32), r=4, alpha=8,
                       fp4=True, gradient_checkpointing=False)


def test_grouped_layers_count_once_as_their_stack_and_the_bytes_are_codes_plus_scales():
    model = _model()
    # per layer: q 256x256, k/v 128x256 each, o 256x256, gate/up 512x256 each, down 256x512
    shapes = [(256, 256), (128, 256), (128, 256), (256, 256), (512, 256), (512, 256), (256, 512)] * 2

    def cost(n, k):  # codes (K/2 bytes a row), FP8 scales (K/16), bf16 per-channel scales (2)
        return n * (k // 2 + k // 16 + 2)

    assert len(_operands(model, [])) == 14
    assert humming_copy_bytes(model) == sum(cost(n, k) for n, k in shapes)
    groups = group_projections(model, kinds=("fp4",))
    assert len(groups) == 8  # q|k|v, o, gate|up and down of each layer (o and down: groups of one)
    ops = _operands(model, groups)
    assert len(ops) == 8  # every matmul once, through its group
    assert sorted(op[0].shape[0] for op in ops) == [256, 256, 256, 256, 512, 512, 1024, 1024]
    assert [op[3] for op in ops] == [(256, 128, 128), (256,), (512, 512), (256,)] * 2  # a global scale per segment
    stacked = [(512, 256), (256, 256), (1024, 256), (256, 512)] * 2
    assert humming_copy_bytes(model, groups) == sum(cost(n, k) for n, k in stacked)
    detach_humming_copies(model, groups)  # nothing held: a no-op


def test_shapes_humming_does_not_tile_are_left_out():
    config = qwen25_config("7B", hidden_size=192, intermediate_size=320, num_hidden_layers=1, num_attention_heads=3,
                           num_key_value_heads=1, vocab_size=512, pad_token_id=0, bos_token_id=0, eos_token_id=1)
    model = build_random_model(config, fp4=True, device="cpu", dtype=torch.float32)
    # K = 192 is not a multiple of 128 (q, k, v, o, gate, up); down has K = 320: none fits
    assert _operands(model, []) == [] and humming_copy_bytes(model) == 0


def test_copies_are_tracked_by_identity_dropped_one_by_one_and_forgotten_with_their_tensor():
    import gc

    from qerl.quant.kernels import humming_fp4 as hf

    class FakeCopy:
        def nbytes(self):
            return 7

    hf.clear()
    a, b, c = (torch.zeros(4, 8, dtype=torch.uint8) for _ in range(3))  # equal contents: == is elementwise
    for t in (a, b, c):
        t.__dict__[hf._ATTR] = FakeCopy()
        hf._track(t)
    assert hf.copies_nbytes() == 21
    hf.drop(a)
    assert not hf.has_copy(a) and hf.has_copy(b) and hf.copies_nbytes() == 14
    del c, t  # the loop variable holds c too
    gc.collect()
    assert hf.copies_nbytes() == 7 and len(hf._live) == 1
    hf.clear()
    assert not hf.has_copy(b) and hf.copies_nbytes() == 0 and not hf._live


def test_one_weight_of_each_shape_is_built_at_once_then_the_rest_in_order(monkeypatch):
    """build_copies: the first weight of each distinct shape in its own thread (humming compiles per shape), all
    of them running together; the others after, one each, in the operands' order; humming's compile seconds
    count the wall clock, not the sum over threads."""
    import threading
    import time

    from qerl.quant import humming_copies
    from qerl.quant.kernels import humming_fp4

    model = _model()
    groups = group_projections(model, kinds=("fp4",))
    ops = _operands(model, groups)
    distinct = {humming_copies._shape_key(op) for op in ops}
    assert len(distinct) == 4 and len(ops) == 8  # two layers of the same four shapes
    lock, calls = threading.Lock(), []
    everyone_in = threading.Barrier(len(distinct), timeout=10)  # raises unless all leads run at the same time

    def fake(wp, ws, gs, segs, dtype, rows):
        with lock:
            calls.append((id(wp), threading.get_ident()))
            lead = len(calls) <= len(distinct)
        if lead:
            everyone_in.wait()
            time.sleep(0.05)
            humming_fp4.PREPARE["seconds"] += 0.05  # as each thread's _prepare would
        return ("copy", id(wp), dtype, rows)

    monkeypatch.setattr(humming_fp4, "humming_weight", fake)
    monkeypatch.setitem(humming_fp4.PREPARE, "seconds", 0.0)
    out = humming_copies.build_copies(ops, torch.bfloat16, (24, 32))
    assert out == [("copy", id(op[0]), torch.bfloat16, (24, 32)) for op in ops]  # every weight once, in order
    assert sorted(c[0] for c in calls) == sorted(id(op[0]) for op in ops)
    assert len({t for _, t in calls[:4]}) == 4  # the leads: one thread each
    assert 0.05 <= humming_fp4.PREPARE["seconds"] < 4 * 0.05  # wall clock, under the threads' sum


def test_the_copy_key_follows_in_place_writes_and_takes_inference_tensors():
    """humming_fp4.HummingWeight._key: a weight rewritten in place gets a new key (refresh_stale rebuilds its copy);
    weights made under torch.inference_mode, which keep no version counter, are keyed by address."""
    from qerl.quant.kernels.humming_fp4 import HummingWeight

    def operands():
        return torch.zeros(64, 64, dtype=torch.uint8), torch.ones(64, 8), torch.ones(1)

    wp, ws, gs = operands()
    before = HummingWeight._key(wp, ws, gs, (64,), torch.bfloat16)
    assert HummingWeight._key(wp, ws, gs, (64,), torch.bfloat16) == before
    ws.mul_(2)
    assert HummingWeight._key(wp, ws, gs, (64,), torch.bfloat16) != before
    with torch.inference_mode():
        frozen = operands()
    key = HummingWeight._key(*frozen, (64,), torch.bfloat16)
    assert key == HummingWeight._key(*frozen, (64,), torch.bfloat16) and key[-2:] == ((64,), torch.bfloat16)


def test_weights_that_hold_a_copy_are_not_sent_to_threads(monkeypatch):
    """A resident engine's next rollout: every weight already holds its copy, so build_copies asks for each in the
    caller's thread (humming_weight returns the held copy, or refreshes a stale one in place)."""
    import threading

    from qerl.quant import humming_copies
    from qerl.quant.kernels import humming_fp4

    model = _model()
    ops = _operands(model, group_projections(model, kinds=("fp4",)))
    threads = []
    monkeypatch.setattr(humming_fp4, "has_copy", lambda wp: True)
    monkeypatch.setattr(humming_fp4, "humming_weight",
                        lambda wp, *a: threads.append(threading.get_ident()) or id(wp))
    assert humming_copies.build_copies(ops, torch.bfloat16, None) == [id(op[0]) for op in ops]
    assert threads == [threading.get_ident()] * len(ops)
