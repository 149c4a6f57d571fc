"""Dense copies of the FP4 base for a policy update (qerl.update_copies, train.dense_weights): the training
forward and backward over a copy equal the packed path's (float64), no saved-tensor hook ever sees the copy,
"auto" makes them only where they fit, and the trainer's update drops them when it ends."""
from __future__ import annotations

import pytest
import torch

from qerl import update_copies as uc
from qerl.quant.dense_copies import attach_dense_copies, detach_dense_copies
from qerl.quant.linear import DENSE_COPY_ATTR, DenseCopyFunction, FP4Linear

GIB = 1 << 30


def _layer(out=48, inp=64, dtype=torch.float64):
    torch.manual_seed(0)
    return FP4Linear.from_linear(torch.nn.Linear(inp, out, bias=True, dtype=dtype))


def _grads(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return y.detach(), x.grad


def test_training_over_a_copy_equals_the_packed_path_in_float64():
    layer = _layer()
    x = torch.randn(5, 64, dtype=torch.float64)
    ref_y, ref_g = _grads(layer, x)
    attach_dense_copies(layer, [], torch.float64)
    calls = []
    real = DenseCopyFunction.apply
    DenseCopyFunction.apply = lambda *a: calls.append(1) or real(*a)
    try:
        y, g = _grads(layer, x)
    finally:
        DenseCopyFunction.apply = real
    assert calls  # the copy was read, not the packed weight
    torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, ref_g, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # a copy no longer equal to W: the training forward reads it, at any rows
        getattr(layer, DENSE_COPY_ATTR).mul_(2)
    y2, _ = _grads(layer, x)
    torch.testing.assert_close(y2 - layer.bias.detach(), 2 * (ref_y - layer.bias.detach()), rtol=1e-12, atol=1e-12)


def test_no_saved_tensor_hook_sees_the_copy():
    """Activation offloading (save_on_cpu) packs every saved tensor: the copy must not be one, or each forward
    would move the whole weight to the host."""
    layer = _layer(dtype=torch.float32)
    attach_dense_copies(layer, [], torch.float32)
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    x = torch.randn(3, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum().backward()
    assert (48, 64) not in seen and x.grad is not None


def test_fused_lora_base_ops_read_the_copy_in_its_dtype_only():
    from qerl.fused_lora import base_ops

    layer = _layer()
    x = torch.randn(4, 64, dtype=torch.float64)
    g = torch.randn(4, 48, dtype=torch.float64)
    fwd, bwd = base_ops(layer, torch.float64)
    ref_y, ref_g = fwd(x), bwd(g)
    attach_dense_copies(layer, [], torch.float64)
    with torch.no_grad():
        getattr(layer, DENSE_COPY_ATTR).zero_()
    fwd, bwd = base_ops(layer, torch.float64)
    assert torch.equal(fwd(x), layer.bias.expand(4, 48)) and torch.equal(bwd(g), torch.zeros(4, 64, dtype=g.dtype))
    fwd, bwd = base_ops(layer, torch.float32)  # no copy in float32: the packed weight
    torch.testing.assert_close(fwd(x.float()).double(), ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bwd(g.float()).double(), ref_g, rtol=1e-5, atol=1e-5)


def test_auto_makes_copies_only_where_they_fit(monkeypatch):
    import qerl.rollout.kv_pool as kv_pool

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(kv_pool, "free_device_memory", lambda device: 10 * GIB)
    assert not uc.copies_fit(2 * GIB, gpu, None)  # before the first update measured its need
    assert uc.copies_fit(2 * GIB, gpu, 8 * GIB) and not uc.copies_fit(2 * GIB, gpu, 8 * GIB + 1)
    assert not uc.copies_fit(0, gpu, 0)
    monkeypatch.setattr(uc.dc, "available_host_bytes", lambda: 8 * GIB)
    assert uc.copies_fit(2 * GIB, cpu, None) and not uc.copies_fit(2 * GIB + 1, cpu, None)  # a quarter of it
    assert not uc.copies_fit(GIB, torch.device("meta"), 0)


def test_update_copies_modes_and_the_engines_kept_copies(monkeypatch):
    """Copies in the dtype the layers compute in (float64 here), made and dropped per mode; the engine's kept."""
    model = torch.nn.ModuleList([_layer(), _layer(out=32)])
    attached = lambda: [DENSE_COPY_ATTR in m.__dict__ for m in model]  # noqa: E731
    with uc.update_copies(model, False, None) as made:
        assert made == 0 and attached() == [False, False]
    with uc.update_copies(model, True, None) as made:
        assert made == (48 + 32) * 64 * 8 and attached() == [True, True]
    assert attached() == [False, False]  # dropped when the update ends
    monkeypatch.setattr(uc, "copies_fit", lambda need, device, reserve: reserve == 1)
    with uc.update_copies(model, "auto", None) as made:
        assert made == 0 and attached() == [False, False]
    with pytest.raises(RuntimeError, match="boom"), uc.update_copies(model, "auto", 1) as made:
        assert made > 0 and attached() == [True, True]
        raise RuntimeError("boom")
    assert attached() == [False, False]  # dropped on an error too
    attach_dense_copies(model, [], torch.float64)  # the rollout engine's, kept through the update
    with uc.update_copies(model, True, None) as made:
        assert made == 0
    assert attached() == [True, True]  # not ours to drop
    detach_dense_copies(model)


def _fp4_trainer(nvfp4_dir, tmp_path, dense_weights):
    from bench.e2e_workers import _random_reward
    from qerl.config import TrainConfig
    from qerl.policy import LoraSpec, load_policy
    from qerl.trainer import GRPOTrainer

    torch.manual_seed(0)
    model, tok = load_policy(nvfp4_dir, mode="qlora_fp4", dtype=torch.float32, device="cpu",
                             lora=LoraSpec(r=2, alpha=4))
    for name, p in model.named_parameters():  # B != 0: the LoRA term reaches the loss and A's gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    cfg = TrainConfig(mode="qlora_fp4", data={"source": "bench"}, rewards=["bench.e2e_workers:_random_reward"],
                      num_generations=2, batch_size=2, micro_batch_size=2, max_steps=1, max_completion_length=4,
                      aqn=None, lora={"lora_r": 2, "lora_alpha": 4}, dtype="float32", dense_weights=dense_weights,
                      learning_rate=1e-2)
    return GRPOTrainer(cfg, model, tok, [list(range(100, 108)), list(range(200, 206))], ["1", "2"],
                       [("random", _random_reward, 1.0)], checkpoint_dir=tmp_path / str(dense_weights))


def test_trainer_update_over_copies_equals_the_packed_update(nvfp4_dir, tmp_path, monkeypatch):
    import qerl.quant.linear as linear_mod

    packed = _fp4_trainer(nvfp4_dir, tmp_path, False)
    copied = _fp4_trainer(nvfp4_dir, tmp_path, True)
    batch = packed.rollout(0)
    start = {n: p.detach().clone() for n, p in packed.model.named_parameters() if p.requires_grad}
    calls = {"packed": 0}
    real = linear_mod.fp4_matmul_t
    monkeypatch.setattr(linear_mod, "fp4_matmul_t", lambda *a: calls.__setitem__("packed", 1) or real(*a))
    ref = packed.update(batch, 0)
    assert calls["packed"] and ref["update_dense_copies_gib"] == 0
    calls["packed"] = 0
    got = copied.update(batch, 0)
    assert not calls["packed"]  # every grad_input read a copy
    assert got["update_dense_copies_gib"] > 0
    assert not any(DENSE_COPY_ATTR in m.__dict__ for m in copied.model.modules())
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key  # float32: the same GEMMs' values
    moved = 0
    for (n, a), (_, b) in zip(packed.model.named_parameters(), copied.model.named_parameters()):
        if a.requires_grad:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=n)
            moved += int(not torch.equal(a, start[n]))
    assert moved  # the update changed the adapters: the comparison above is not between two untouched models


def test_an_fp4_update_out_of_memory_names_the_copies_knob(nvfp4_dir, tmp_path, monkeypatch):
    from qerl.errors import QerlError

    trainer = _fp4_trainer(nvfp4_dir, tmp_path, "auto")
    batch = trainer.rollout(0)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.Tensor, "backward", oom)
    with pytest.raises(QerlError, match=r"or set train.dense_weights: false$"):
        trainer.update(batch, 0)
    trainer.cfg.dense_weights = False
    with pytest.raises(QerlError) as err:
        trainer.update(batch, 0)
    assert "dense_weights" not in str(err.value)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [7, 300, 2100])
def test_gpu_training_over_a_copy_matches_the_packed_kernels(rows):
    """bf16 on CUDA, the row counts of each packed path (few-row kernels, humming or dequantize + cuBLAS, the
    chunked many-row path): forward and grad_input over a copy equal the packed path's within bf16 GEMM rounding,
    both against float64."""
    from qerl.fused_lora import base_ops

    torch.manual_seed(0)
    dense = torch.nn.Linear(1024, 768, bias=True, dtype=torch.float64)
    layer = FP4Linear.from_linear(dense).to("cuda")
    layer.compute_dtype = torch.bfloat16
    layer.bias.data = layer.bias.data.to(torch.bfloat16)
    w64 = layer.dequantize_weight(torch.float64)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(rows, 768, device="cuda", dtype=torch.bfloat16)
    ref_y = x.double() @ w64.T + layer.bias.double()
    ref_gx = g.double() @ w64
    packed = [t.double() for t in (base_ops(layer, torch.bfloat16)[0](x), base_ops(layer, torch.bfloat16)[1](g))]
    attach_dense_copies(layer, [], torch.bfloat16)
    xg = x.clone().requires_grad_()
    y = layer(xg)
    y.backward(g)
    fwd, bwd = base_ops(layer, torch.bfloat16)
    for got, ref, was in ((y.detach(), ref_y, packed[0]), (xg.grad, ref_gx, packed[1]), (fwd(x), ref_y, packed[0]),
                          (bwd(g), ref_gx, packed[1])):
        err, err_packed = (got.double() - ref).abs().max(), (was - ref).abs().max()
        assert err <= 2 * err_packed + 1e-2 * ref.abs().max(), (rows, float(err), float(err_packed))
    detach_dense_copies(layer)
    assert uc.copies_fit(GIB, torch.device("cuda"), 0)  # an H100/H200 has a spare GiB at the start of a test
