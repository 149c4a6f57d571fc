"""qerl.fused_elementwise: compiled RMSNorm and SiLU(gate) * up give transformers' outputs and gradients."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from qerl import fused_elementwise as fe
from qerl.bench.random_models import attach_lora, build_random_model, qwen25_config
from qerl.tiled_mlp import tile_mlps


def _config(layers: int = 2, vocab: int = 300):
    special = {} if vocab > 152000 else {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    return qwen25_config("tiny", hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, **special)


def _model(device="cpu", dtype=torch.float64, layers=2, vocab=300):
    model = attach_lora(build_random_model(_config(layers, vocab), fp4=False, device=device, dtype=dtype, seed=0),
                        r=4, alpha=8, fp4=False, gradient_checkpointing=True)
    gen = torch.Generator(device="cpu").manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_" in name:  # the same adapters in every copy; B non-zero so its gradient flows everywhere
            p.data = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.2).to(p)
        if "norm" in name:  # non-trivial scales, trained here so their gradients are compared too
            p.data = (1 + 0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64)).to(p)
            p.requires_grad_(True)
    return model


def _loss_and_grads(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), grads


@pytest.fixture
def on_cpu(monkeypatch):
    """The compiled path on CPU tensors, through AOTAutograd without code generation (no C++ toolchain needed)."""
    monkeypatch.setattr(fe, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(fe, "BACKEND", "aot_eager")
    calls = []
    real = fe._compiled
    monkeypatch.setattr(fe, "_compiled", lambda name: calls.append(name) or real(name))
    return calls


def test_reference_is_transformers_rmsnorm_in_float64_and_bf16():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(48, eps=1e-6)
    norm.weight.data = torch.randn(48)
    x = torch.randn(5, 7, 48) * 3
    for dtype in (torch.float64, torch.bfloat16):
        n, xx = norm.to(dtype), x.to(dtype)
        assert torch.equal(fe.rms_norm_reference(xx, n.weight, n.variance_epsilon), n(xx))


def test_training_forward_and_backward_match_eager(on_cpu):
    ids = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(2))
    plain, fused = _model(), _model()
    assert fe.fuse_elementwise(fused) == 2 * 2 + 1 + 2  # 2 norms per layer + the final one, 2 MLPs
    assert fe.fused_modules(fused) == 7
    logits0, g0 = _loss_and_grads(plain.train(), ids)
    logits1, g1 = _loss_and_grads(fused.train(), ids)
    # the forward (5 norms, 2 MLPs) and the checkpointed layers' recomputation (4, 2) ran the compiled functions
    assert on_cpu.count("rms_norm") == 5 + 4 and on_cpu.count("silu_mul") == 2 + 2
    torch.testing.assert_close(logits1, logits0, rtol=1e-10, atol=1e-10)
    assert g0.keys() == g1.keys() and any("norm" in n for n in g0) and any("lora_A" in n for n in g0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-9, atol=1e-11, msg=name)


def test_no_grad_and_unfused_calls_run_the_original(on_cpu):
    model = _model()
    fe.fuse_elementwise(model)
    ids = torch.randint(0, 300, (2, 6))
    with torch.no_grad():
        model(input_ids=ids)
    assert on_cpu == []  # rollouts / evaluation: transformers' own forward
    assert fe.fuse_elementwise(model, False) == 7
    assert fe.fused_modules(model) == 0
    assert not any("forward" in vars(m) for m in model.modules())
    model(input_ids=ids).logits.sum().backward()
    assert on_cpu == []


def test_modules_of_another_form_are_left_alone():
    class OnePlusNorm(nn.Module):  # Gemma's form: x_hat * (1 + weight)
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(16))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return fe.rms_norm_reference(x, 1 + self.weight, self.variance_epsilon)

    class GeluMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(8, 16)
            self.act_fn = nn.SiLU()

        def forward(self, x):  # not SiLU(gate) * up
            return self.down_proj(nn.functional.gelu(self.gate_proj(x)) + self.up_proj(x))

    net = nn.Sequential(OnePlusNorm(), GeluMLP())
    assert fe.fuse_elementwise(net) == 0


def test_fuse_before_tiling_keeps_the_tiles(on_cpu, monkeypatch):
    """The trainer fuses, then tiles: each slice runs the compiled MLP; an already tiled MLP is not re-wrapped."""
    import qerl.tiled_mlp as tiled

    model = _model()
    fe.fuse_elementwise(model)
    tile_mlps(model, 3)
    slices = []
    real = tiled.checkpoint
    monkeypatch.setattr(tiled, "checkpoint", lambda fn, part, **kw: slices.append(part.shape) or real(fn, part, **kw))
    ids = torch.randint(0, 300, (2, 9))
    model(input_ids=ids).logits.sum().backward()
    # 2 layers x 3 slices, in the forward and in the layer's checkpointed recomputation; each slice's MLP runs
    # again when its own checkpoint recomputes it in backward (how often with nested checkpoints: torch's business)
    assert len(slices) == 2 * 3 * 2 and on_cpu.count("silu_mul") >= 2 * 3 * 2
    tile_mlps(model, 1)
    assert fe.fuse_elementwise(model, True) == 7  # re-fusing after untiling finds every module again
    tile_mlps(model, 2)
    assert fe.fuse_elementwise(model, True) == 7  # the tiles around the fused MLPs stay
    slices.clear()
    model(input_ids=ids).logits.sum().backward()
    assert len(slices) == 2 * 2 * 2
    tile_mlps(model, 1)

    plain = _model()
    tile_mlps(plain, 2)
    assert fe.fuse_elementwise(plain) == 5  # an MLP tiled first has its own instance forward: not swapped


def test_trainer_fuses_by_config(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from qerl.config import TrainConfig
    from qerl.trainer import GRPOTrainer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for flag in (True, False):
        model = _model(dtype=torch.float32, vocab=152064)
        cfg = TrainConfig(mode="lora", data={"source": "x"}, rewards=["format"], batch_size=2, num_generations=2,
                          micro_batch_size=2, max_completion_length=4, aqn=None, fused_elementwise=flag)
        trainer = GRPOTrainer(cfg, model, tok, [[1, 2, 3]] * 2, ["1"] * 2,
                              [("format", lambda c, **k: [0.0] * len(c), 1.0)], checkpoint_dir=tmp_path / str(flag))
        assert (fe.fused_modules(trainer.model) == 7) is flag
        trainer.engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inductor_kernels_match_eager_on_the_gpu(dtype):
    import copy

    ids = torch.randint(0, 300, (4, 37), generator=torch.Generator().manual_seed(3)).cuda()
    ref64 = _model("cuda", torch.float64)
    plain, fused = copy.deepcopy(ref64).to(dtype), copy.deepcopy(ref64).to(dtype)
    logits64, g64 = _loss_and_grads(ref64.train(), ids)
    assert fe.fuse_elementwise(fused) == 7
    logits0, g0 = _loss_and_grads(plain.train(), ids)
    logits1, g1 = _loss_and_grads(fused.train(), ids)
    # against float64: the compiled path is as close as transformers' eager path in the same dtype
    err = lambda a, b: float((a.double() - b).abs().max() / b.abs().max())  # noqa: E731
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    assert err(logits0, logits64) < tol and err(logits1, logits64) <= max(2 * err(logits0, logits64), tol / 10)
    assert g64.keys() == g1.keys() and len(g64) > 0
    for name in g64:
        assert err(g1[name], g64[name]) <= max(2 * err(g0[name], g64[name]), tol / 10), name
