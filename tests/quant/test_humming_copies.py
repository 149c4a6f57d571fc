"""qerl.quant.humming_copies on CPU: which matmuls get a copy and what they would cost (no GPU, no humming)."""
from __future__ import annotations

import contextlib

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


def test_one_compile_per_shape_all_at_once_and_the_caller_waits_for_them(monkeypatch):
    """build_copies: every copy made once, in the operands' order; each distinct layer config compiles once, all of
    them at the same time on other threads (humming compiles per shape); without `background` the caller returns
    only once all are compiled, and humming's compile seconds count the wall clock it waited, not the sum over
    threads."""
    import threading
    import time

    from qerl.quant import humming_copies
    from qerl.quant.kernels import humming_fp4

    model = _model()
    groups = group_projections(model, kinds=("fp4",))
    ops = _operands(model, groups)
    distinct = {tuple(op[0].shape) + op[3] for op in ops}
    assert len(distinct) == 4 and len(ops) == 8  # two layers of the same four shapes
    everyone_in = threading.Barrier(len(distinct), timeout=10)  # raises unless all compiles run at the same time
    calls, log = [], []

    class Compiling(_FakeCopy):
        def prepare(self, background=False):
            everyone_in.wait()
            time.sleep(0.05)
            return super().prepare(background)

    def fake(wp, ws, gs, segs, dtype, rows, defer=False):
        assert defer and dtype == torch.bfloat16 and rows == (24, 32)
        calls.append(id(wp))
        return Compiling(tuple(wp.shape) + segs, log=log)

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(humming_fp4, "humming_weight", fake)
    monkeypatch.setitem(humming_fp4.PREPARE, "seconds", 0.0)
    out = humming_copies.build_copies(ops, torch.bfloat16, (24, 32))
    assert calls == [id(op[0]) for op in ops]  # every weight once, in order
    assert sorted(key for key, _ in log) == sorted(distinct)  # one compile per shape
    assert all(c.tuning == f"table-{c.key}" for c in out) and not humming_fp4._PENDING  # all done on return
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
    caller's thread (humming_weight returns the held copy, or refreshes a stale one in place) and compiles nothing."""
    import threading

    from qerl.quant import humming_copies
    from qerl.quant.kernels import humming_fp4

    model = _model()
    ops = _operands(model, group_projections(model, kinds=("fp4",)))
    threads, sent = [], []

    def held(wp, *a, **k):
        threads.append(threading.get_ident())
        copy = _FakeCopy(id(wp))
        copy.tuning = "table"  # a held copy's kernels were compiled when it was built
        return copy

    monkeypatch.setattr(humming_fp4, "has_copy", lambda wp: True)
    monkeypatch.setattr(humming_fp4, "humming_weight", held)
    monkeypatch.setattr(humming_fp4, "compile_in_background", lambda copies: sent.extend(copies))
    assert [c.key for c in humming_copies.build_copies(ops, torch.bfloat16, None)] == [id(op[0]) for op in ops]
    assert threads == [threading.get_ident()] * len(ops) and not sent


class _FakeCopy:
    """What compile_in_background and build_copies ask of a HummingWeight: job_key, prepare, tuning, ready."""

    def __init__(self, key, hold=None, log=None, done_before=False):
        self.key, self.hold, self.log, self.done_before = key, hold, log, done_before
        self.device, self.tuning, self.ready = torch.device("cpu"), None, None

    def job_key(self):
        return self.key

    def compiled_before(self):
        return self.done_before

    def prepare(self, background=False):
        if self.log is not None:
            self.log.append((self.key, background))
        if self.hold is not None:
            self.hold.wait()  # the test releases it: "compiling" until then
        return f"table-{self.key}"


def test_background_compiles_once_per_job_all_jobs_together_and_the_wait_is_counted(monkeypatch):
    """compile_in_background: one prepare per distinct job_key, the jobs running at the same time on a background
    thread while the caller goes on; every copy gets its job's table; copy_ready says so only once done;
    wait_pending blocks until then and counts the seconds blocked as humming's (foreground) compile time."""
    import threading
    import time

    from qerl.quant.kernels import humming_fp4

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setitem(humming_fp4.PREPARE, "seconds", 0.0)
    release, log = threading.Event(), []
    both_in = threading.Barrier(3, timeout=10)  # the two jobs and this test: raises unless the jobs overlap

    class Held(_FakeCopy):
        def prepare(self, background=False):
            both_in.wait()
            return super().prepare(background)

    copies = [Held("qkv", release, log), Held("o", release, log), Held("qkv", release, log)]
    future = humming_fp4.compile_in_background(copies)
    both_in.wait()  # both jobs started, and this thread was not held up
    assert all(c.ready is future for c in copies) and not future.done()
    wp = torch.zeros(4, 4, dtype=torch.uint8)
    wp.__dict__[humming_fp4._ATTR] = copies[0]
    assert humming_fp4.has_copy(wp) and not humming_fp4.copy_ready(wp)
    threading.Timer(0.2, release.set).start()
    start = time.perf_counter()
    humming_fp4.wait_pending()
    assert time.perf_counter() - start >= 0.15 and humming_fp4.PREPARE["seconds"] >= 0.15
    assert sorted(log) == [("o", True), ("qkv", True)]  # one prepare per job, marked as background work
    assert [c.tuning for c in copies] == ["table-qkv", "table-o", "table-qkv"]
    assert humming_fp4.copy_ready(wp) and not humming_fp4._PENDING
    humming_fp4.wait_pending()  # nothing pending: returns at once
    assert humming_fp4.compile_in_background([]) is None


def test_build_copies_in_the_background_repacks_here_and_compiles_only_what_is_new(monkeypatch):
    """build_copies(background=True): every copy is made (repacked) in the caller's thread with its compile
    deferred; copies whose job this process compiled before prepare at once (a memo lookup), so later rollouts
    never see a copy that is not ready; only the new jobs go to the background."""
    from qerl.quant import humming_copies
    from qerl.quant.kernels import humming_fp4

    model = _model()
    ops = _operands(model, group_projections(model, kinds=("fp4",)))
    made, log = [], []

    def fake(wp, ws, gs, segs, dtype, rows, defer=False):
        assert defer
        c = _FakeCopy(tuple(wp.shape), log=log, done_before=wp.shape[0] == 256)
        made.append(c)
        return c

    sent = []
    monkeypatch.setattr(humming_fp4, "humming_weight", fake)
    monkeypatch.setattr(humming_fp4, "compile_in_background", lambda copies: sent.extend(copies))
    out = humming_copies.build_copies(ops, torch.bfloat16, (32,), background=True)
    assert out == made and len(out) == len(ops)
    assert all(c.tuning is not None for c in out if c.done_before)
    assert {(k, b) for k, b in log} == {((256, 128), False), ((256, 256), False)}  # o and down: compiled before
    assert sent == [c for c in out if not c.done_before] and all(c.tuning is None for c in sent)


def test_dispatch_skips_a_copy_still_compiling_except_in_a_decode_step(monkeypatch):
    """A prefill while humming compiles takes the other kernels; a decode step's warm-up and its capture take
    humming (and wait for it), so the captured graph replays the kernels its warm-up ran."""
    from qerl.quant import dispatch
    from qerl.quant.kernels import humming_fp4
    from qerl.quant.kernels.device import decode_step_launches

    ready = {"now": False}
    monkeypatch.setattr(humming_fp4, "fits", lambda wp: True)
    monkeypatch.setattr(humming_fp4, "available", lambda device: True)
    monkeypatch.setattr(humming_fp4, "has_copy", lambda wp: True)
    monkeypatch.setattr(humming_fp4, "copy_ready", lambda wp: ready["now"])
    x, wp = torch.zeros(32, 128), torch.zeros(64, 64, dtype=torch.uint8)
    assert not dispatch._humming_fits(x, wp)
    with decode_step_launches():
        assert dispatch._humming_fits(x, wp)
    ready["now"] = True
    assert dispatch._humming_fits(x, wp)
    monkeypatch.setattr(humming_fp4, "has_copy", lambda wp: False)
    assert not dispatch._humming_fits(x, wp)  # auto: no copy, no humming (QERL_FP4_HUMMING=1 builds one)


def test_a_copy_runs_only_once_its_kernels_are_compiled(monkeypatch):
    """HummingWeight.run waits for its background compile before launching (humming would otherwise compile
    the whole table itself, inside the forward)."""
    import threading
    import types

    from qerl.quant.kernels import humming_fp4

    seen = []
    hw = object.__new__(humming_fp4.HummingWeight)
    hw.config, hw.tensors, hw.locks, hw.tuning = "cfg", {"weight": "w"}, "locks", None
    forward = types.SimpleNamespace(humming_forward=lambda config, **kw: seen.append(kw["tuning_config"]))
    monkeypatch.setattr(humming_fp4, "_humming", lambda: {"forward": forward})
    gate = threading.Event()

    def compile_it():
        gate.wait()
        hw.tuning = "table"

    hw.ready = humming_fp4._background().submit(compile_it)
    humming_fp4._PENDING.append(hw.ready)
    threading.Timer(0.1, gate.set).start()
    hw.run(torch.zeros(2, 2), torch.zeros(2, 2))
    assert seen == ["table"] and hw.ready is None and not humming_fp4._PENDING
