"""qerl.fused_elementwise: compiled RMSNorm and SiLU(gate) * up give transformers' outputs and gradients."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from qerl import fused_elementwise as fe
from bench.random_models import attach_lora, build_random_model, qwen25_config
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
    assert fe.fuse_elementwise(fused) == 2 * 2 + 1 + 2 + 1  # 2 norms per layer + the final one, 2 MLPs, lm_head
    assert fe.fused_modules(fused) == 8
    logits0, g0 = _loss_and_grads(plain.train(), ids)
    logits1, g1 = _loss_and_grads(fused.train(), ids)
    # the forward (5 norms, 2 MLPs) and the checkpointed layers' recomputation (4, 2) ran the compiled functions
    assert on_cpu.count("rms_norm") == 5 + 4 and on_cpu.count("silu_mul") == 2 + 2
    torch.testing.assert_close(logits1, logits0, rtol=1e-10, atol=1e-10)
    assert g0.keys() == g1.keys() and any("norm" in n for n in g0) and any("lora_A" in n for n in g0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-9, atol=1e-11, msg=name)


def test_target_logprobs_match_the_custom_function_in_float64(on_cpu):
    from qerl.grpo import TargetLogProb

    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(7, 50, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    targets = torch.randint(0, 50, (7,), generator=gen)
    g = torch.randn(7, generator=gen, dtype=torch.float64)
    head = nn.Linear(4, 50)
    for temperature in (1.0, 0.7):
        want = TargetLogProb.apply(logits, targets, temperature)
        (gw,) = torch.autograd.grad(want[0], logits, g)
        assert fe.target_logprobs(head, logits, targets, temperature) is None  # not marked: the caller's path
        setattr(head, fe._HEAD_MARK, True)
        got = fe.target_logprobs(head, logits, targets, temperature)
        setattr(head, fe._HEAD_MARK, False)
        (gg,) = torch.autograd.grad(got[0], logits, g)
        assert not got[1].requires_grad
        for a, b in ((got[0], want[0]), (got[1], want[1]), (gg, gw)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # both compute in fp32
    assert on_cpu == ["target_logprobs"] * 2


def test_token_logprobs_of_a_fused_model_match(on_cpu):
    from qerl.grpo import token_logprobs

    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    results = []
    for fused in (False, True):
        model = _model().train()
        fe.fuse_elementwise(model, fused)
        lp, ent = token_logprobs(model, ids, mask, 5, temperature=0.9, chunk_size=4)
        (lp * torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype).view_as(lp)).sum().backward()
        results.append((lp.detach(), ent, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert on_cpu.count("target_logprobs") >= 3  # 10 positions in chunks of 4 (+ their recomputation)
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent1, ent0, rtol=1e-10, atol=1e-10)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:  # both heads compute in fp32 whatever the model's dtype: fp32-level agreement
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=2e-6 * float(g0[name].abs().max()), msg=name)


def test_no_grad_and_unfused_calls_run_the_original(on_cpu):
    model = _model()
    fe.fuse_elementwise(model)
    ids = torch.randint(0, 300, (2, 6))
    with torch.no_grad():
        model(input_ids=ids)
    assert on_cpu == []  # rollouts / evaluation: transformers' own forward
    assert fe.fuse_elementwise(model, False) == 8
    assert fe.fused_modules(model) == 0
    assert not any("forward" in vars(m) for m in model.modules())
    model(input_ids=ids).logits.sum().backward()
    assert on_cpu == []


def test_fp4_lora_model_is_fused_and_trains_the_same(on_cpu):
    """FP4 decoder layers (packed bytes, FP8 scales) + LoRA: the probe runs in the adapters' dtype, every module is
    recognised, and one forward/backward gives the eager gradients."""
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(7))
    grads = []
    for fused in (False, True):
        model = attach_lora(build_random_model(_config(), fp4=True, device="cpu", dtype=torch.float32, seed=0),
                            r=4, alpha=8, fp4=True, gradient_checkpointing=True)
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = torch.randn(p.shape, generator=gen) * 0.2
        assert fe.fuse_elementwise(model, fused) == (8 if fused else 0)
        grads.append(_loss_and_grads(model.train(), ids)[1])
    assert on_cpu.count("silu_mul") == 4 and grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 7 * 2
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0,
                                   atol=1e-5 * float(grads[0][name].abs().max()), msg=name)


def test_a_failing_compile_warns_once_and_runs_eager(monkeypatch):
    def broken(fn, **kw):
        def run(*args):
            raise torch._dynamo.exc.TorchDynamoException("no C++ compiler")
        return run

    monkeypatch.setattr(fe, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(fe, "BACKEND", "broken-for-this-test")
    monkeypatch.setattr(torch, "compile", broken)
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(8))
    plain, fused = _model(), _model()
    fe.fuse_elementwise(fused)
    logits0, g0 = _loss_and_grads(plain.train(), ids)
    with pytest.warns(RuntimeWarning, match="torch.compile of rms_norm failed") as record:
        logits1, g1 = _loss_and_grads(fused.train(), ids)
    assert sum("fused_elementwise" in str(w.message) for w in record) == 2  # rms_norm and silu_mul, once each
    torch.testing.assert_close(logits1, logits0, rtol=1e-12, atol=1e-12)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-12, atol=1e-12)


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
    assert fe.fuse_elementwise(model, True) == 8  # re-fusing after untiling finds every module again
    tile_mlps(model, 2)
    assert fe.fuse_elementwise(model, True) == 8  # the tiles around the fused MLPs stay
    slices.clear()
    model(input_ids=ids).logits.sum().backward()
    assert len(slices) == 2 * 2 * 2
    tile_mlps(model, 1)

    plain = _model()
    tile_mlps(plain, 2)
    assert fe.fuse_elementwise(plain) == 6  # an MLP tiled first has its own instance forward: not swapped


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
        assert (fe.fused_modules(trainer.model) == 8) is flag
        trainer.engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inductor_kernels_match_eager_on_the_gpu(dtype):
    import copy

    ids = torch.randint(0, 300, (4, 37), generator=torch.Generator().manual_seed(3)).cuda()
    ref64 = _model("cuda", torch.float64)
    plain, fused = copy.deepcopy(ref64).to(dtype), copy.deepcopy(ref64).to(dtype)
    logits64, g64 = _loss_and_grads(ref64.train(), ids)
    assert fe.fuse_elementwise(fused) == 8
    logits0, g0 = _loss_and_grads(plain.train(), ids)
    logits1, g1 = _loss_and_grads(fused.train(), ids)
    # against float64 (relative Frobenius error): the compiled path is about as close as transformers' eager path
    # in the same dtype (bf16: each is its own rounding noise, so a margin of 3x)
    err = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-5
    assert err(logits0, logits64) < tol and err(logits1, logits64) <= max(3 * err(logits0, logits64), tol / 10)
    assert g64.keys() == g1.keys() and len(g64) > 0
    for name in g64:
        assert err(g1[name], g64[name]) <= max(3 * err(g0[name], g64[name]), tol / 10), name


@pytest.mark.gpu
def test_compiled_head_logprobs_on_the_gpu_match_and_use_less_memory():
    from qerl.grpo import TargetLogProb

    gen = torch.Generator(device="cuda").manual_seed(6)
    n, vocab = 256, 152064
    logits = (torch.randn(n, vocab, generator=gen, device="cuda") * 4).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=gen, device="cuda")
    g = torch.randn(n, generator=gen, device="cuda")
    head = nn.Linear(4, vocab)
    setattr(head, fe._HEAD_MARK, True)
    ref = [t.double() for t in TargetLogProb.apply(logits.double(), targets, 0.8)]
    (gref,) = torch.autograd.grad(ref[0], logits, g.double())
    peaks, results = [], []
    for fused in (False, True):
        fe.target_logprobs(head, logits, targets, 0.8)  # compile outside the measurement
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = (fe.target_logprobs(head, logits, targets, 0.8) if fused
               else TargetLogProb.apply(logits, targets, 0.8))
        (grad,) = torch.autograd.grad(out[0], logits, g)
        peaks.append(torch.cuda.max_memory_allocated() - base)
        results.append((out[0].double(), out[1].double(), grad.double()))
    for got in results:
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got[2], gref.double(), rtol=1e-2, atol=5e-3 * float(gref.abs().max()))
    assert peaks[1] <= peaks[0], peaks  # no fp32 (N, V) buffer held between forward and backward
