"""Per-step diagnostics against hand-computed values on tiny batches: zero-advantage groups, rollout entropy, the
adapter's update norm, the KL between the quantized and the dense policy; and the format reward a constant answer
cannot farm."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from qerl.diagnostics import QuantKL, rollout_entropy, snapshot, token_kl, update_norm
from qerl.errors import QerlError
from qerl.grpo import group_advantages
from qerl.rewards import call_reward, format_reward, get_reward_fn
from test_train_resume import _trainer, _trainable, task  # noqa: F401 (task: the fixture)


# ------------------------------------------------------------------ reward metrics of one step
def _metrics(table: torch.Tensor, weights=(1.0, 0.1), g: int = 8) -> dict[str, float]:
    from qerl.trainer import GRPOTrainer

    trainer = SimpleNamespace(cfg=SimpleNamespace(num_generations=g),
                              reward_fns=[("correctness", None, weights[0]), ("answer_line_format", None, weights[1])])
    rewards = GRPOTrainer._weighted_total(trainer, table[:, :-3])
    return GRPOTrainer._reward_metrics(trainer, table, rewards)


def test_step_metrics_on_two_groups_of_eight():
    """Group 1 is the collapse: 8 x "Answer: a", wrong, well formed (reward 0.1 each). Group 2: 2 correct of 8."""
    correct = [0.0] * 8 + [1, 1, 0, 0, 0, 0, 0, 0]
    fmt = [1.0] * 8 + [1, 0, 1, 0, 1, 0, 1, 0]
    surprise = [0.5] * 8 + [2.0] * 8  # each row's sum of -log p of its sampled tokens
    lengths = [5.0] * 8 + [4.0] * 8
    table = torch.tensor([correct, fmt, surprise, lengths, [0.0] * 16]).T
    m = _metrics(table)
    assert m["frac_reward_zero_std"] == 0.5
    assert m["frac_groups_none_correct"] == 0.5
    assert m["rewards/correctness/mean"] == pytest.approx(2 / 16)
    assert m["rewards/answer_line_format/mean"] == pytest.approx(12 / 16)
    assert m["rollout/entropy"] == pytest.approx((8 * 0.5 + 8 * 2.0) / (8 * 5 + 8 * 4))  # 20 / 72 nats per token
    rewards = torch.tensor(correct) + 0.1 * torch.tensor(fmt)
    assert (group_advantages(rewards, 8)[:8] == 0).all()  # the collapsed group gives no gradient
    # the collapsed group alone (one rank's share, say): torch's float32 std of it is 8e-9, not 0
    assert _metrics(table[:8])["frac_reward_zero_std"] == 1.0


def test_rollout_entropy_is_an_unbiased_estimate():
    """Tokens drawn from p: the mean of -log p(x) converges on H(p)."""
    p = torch.tensor([0.7, 0.2, 0.1])
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    surprise = -p.log()[x].view(1000, 200).sum(1)
    assert rollout_entropy(surprise, torch.full((1000,), 200.0)) == pytest.approx(float(-(p * p.log()).sum()),
                                                                                  abs=3e-3)
    assert rollout_entropy(torch.zeros(2), torch.zeros(2)) == 0.0  # no tokens: no division by zero


# ------------------------------------------------------------------ update norm
def test_update_norm_of_two_parameters():
    params = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    before = snapshot(params)
    params[0][0] += 3.0  # moved by (3, 0) and (4): ||.|| = 5
    params[1][0, 0] += 4.0
    assert update_norm(before, params) == pytest.approx(5.0)
    assert update_norm([], []) == 0.0


# ------------------------------------------------------------------ KL between two policies
class _OneHotLM(nn.Module):
    """A causal LM whose hidden state is the one-hot input token: the logits after token t are head.weight[:, t]."""

    def __init__(self, logits_after: list[list[float]]):
        super().__init__()
        self.head = nn.Linear(len(logits_after), len(logits_after[0]), bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.tensor(logits_after).T)
        self.body = _OneHotBody(len(logits_after))

    def get_decoder(self):
        return self.body

    def get_output_embeddings(self):
        return self.head


class _OneHotBody(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return SimpleNamespace(last_hidden_state=nn.functional.one_hot(input_ids, self.vocab).float())


def test_token_kl_by_hand():
    """V = 2. After token 0, p is (1/2, 1/2) and q (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3). After
    token 1 both are uniform: 0. At temperature 2 q's logits halve: q = (sqrt 3, 1) / (sqrt 3 + 1)."""
    p = _OneHotLM([[0.0, 0.0], [0.0, 0.0]])
    q = _OneHotLM([[math.log(3.0), 0.0], [0.0, 0.0]])
    ids, attn = torch.tensor([[1, 0, 1, 0]]), torch.ones(1, 4, dtype=torch.long)
    kl = token_kl(p, q, ids, attn, 3, chunk_size=2)  # the distributions after tokens 1, 0, 1
    assert kl.shape == (1, 3)
    assert kl[0].tolist() == pytest.approx([0.0, 0.5 * math.log(4 / 3), 0.0], abs=1e-6)
    q1 = math.sqrt(3) / (math.sqrt(3) + 1)
    want = 0.5 * math.log(0.5 / q1) + 0.5 * math.log(0.5 / (1 - q1))
    assert token_kl(p, q, ids[:, :3], attn[:, :3], 1, temperature=2.0)[0, 0].item() == pytest.approx(want, abs=1e-6)
    assert token_kl(p, p, ids, attn, 3).abs().max() == 0.0


def test_quant_kl_is_off_unless_asked_and_for_dense_policies():
    lora = SimpleNamespace(lora_r=2, lora_alpha=4, target_modules=["q_proj"], fused=True)
    cfg = SimpleNamespace(quant_kl_steps=0, quant_kl_model=None, mode="qlora_fp4", lora=lora, train_norms=False)
    assert QuantKL.for_config(cfg, "cpu", torch.float32) is None
    cfg.quant_kl_steps, cfg.mode = 2, "lora"
    assert QuantKL.for_config(cfg, "cpu", torch.float32) is None  # a dense policy is its own dense twin
    cfg.mode = "qlora_fp4"
    with pytest.raises(QerlError, match="quant_kl_steps needs train.quant_kl_model"):
        QuantKL.for_config(cfg, "cpu", torch.float32)


def test_quant_kl_model_defaults_to_the_experiments_model():
    from qerl.config import ExperimentConfig

    train = {"data": {"source": "x.jsonl"}, "quant_kl_steps": 5}
    exp = ExperimentConfig.model_validate({"model": "resources/m", "train": train,
                                           "eval": {"benchmarks": [{"name": "demo"}]}})
    assert exp.train.quant_kl_model == "resources/m"
    off = ExperimentConfig.model_validate({"model": "resources/m", "train": {"data": {"source": "x.jsonl"}},
                                           "eval": {"benchmarks": [{"name": "demo"}]}})
    assert off.train.quant_kl_steps == 0 and off.train.quant_kl_model is None


def _full_logits_kl(p_model, q_model, ids, attn, keep, temperature):
    """KL(p || q) per token from each model's whole forward (model(...).logits): the reference."""
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    lp = torch.log_softmax(p_model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
                           / temperature, -1)[:, -keep - 1:-1]
    lq = torch.log_softmax(q_model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
                           / temperature, -1)[:, -keep - 1:-1]
    return (lp.exp() * (lp - lq)).sum(-1)


def test_trainer_logs_the_diagnostics(nvfp4_dir, tiny_model_dir, task, tmp_path, monkeypatch):  # noqa: F811
    """Two steps of the tiny NVFP4 model with quant_kl_steps 1 against its own dense original: quant/kl equals the
    KL from two plain forwards, adapter/update_norm the distance the adapter moved, rollout/entropy the rollout's
    own -log p."""
    tr, _ = _trainer(task, nvfp4_dir, tmp_path, monkeypatch, quant_kl_steps=1, quant_kl_model=str(tiny_model_dir),
                     max_steps=2)
    seen = {}
    real_measure, real_update, real_rollout = tr.quant_kl.measure, tr.update, tr.rollout

    def measure(trainer, batch):
        out = real_measure(trainer, batch)
        with torch.no_grad():
            plen = batch.input_ids.shape[1] - batch.completion_len
            mask = batch.attention_mask[:, plen:].float()
            ref = _full_logits_kl(tr.model, tr.quant_kl.twin, batch.input_ids, batch.attention_mask,
                                  batch.completion_len, tr.cfg.rollout.temperature)
        seen.setdefault("kl", []).append((out["quant/kl"], float((ref * mask).sum() / mask.sum())))
        return out

    def update(batch, step):
        before = _trainable(tr.model)
        out = real_update(batch, step)
        moved = [(p.detach() - before[n]).flatten() for n, p in tr.model.named_parameters() if p.requires_grad]
        seen.setdefault("norm", []).append((out["adapter/update_norm"], float(torch.cat(moved).norm())))
        return out

    def rollout(step):
        batch = real_rollout(step)
        plen = batch.input_ids.shape[1] - batch.completion_len
        real = batch.attention_mask[:, plen:].bool()
        seen.setdefault("entropy", []).append((batch.metrics["rollout/entropy"],
                                               float(-batch.rollout_logprobs[real].mean())))
        return batch

    monkeypatch.setattr(tr.quant_kl, "measure", measure)
    monkeypatch.setattr(tr, "update", update)
    monkeypatch.setattr(tr, "rollout", rollout)
    history = tr.train()
    assert all(k in row for row in history for k in ("quant/kl", "adapter/update_norm", "rollout/entropy",
                                                     "frac_reward_zero_std", "frac_groups_none_correct"))
    for key in ("kl", "norm", "entropy"):
        assert len(seen[key]) == 2
        for got, want in seen[key]:
            assert got == pytest.approx(want, rel=1e-4, abs=1e-7), key
    assert all(got > 0 for got, _ in seen["kl"] + seen["norm"])  # NVFP4 moves the policy; the adapter moved
    (tmp_path / "plain").mkdir()
    plain, _ = _trainer(task, nvfp4_dir, tmp_path / "plain", monkeypatch, max_steps=2)
    plain.train()  # measuring changes nothing the run does
    assert all(torch.equal(p, q) for p, q in zip(_trainable(plain.model).values(), _trainable(tr.model).values()))


def test_quant_kl_model_must_be_dense(nvfp4_dir, task, tmp_path, monkeypatch):  # noqa: F811
    with pytest.raises(QerlError, match="quantized checkpoint; use the dense"):
        _trainer(task, nvfp4_dir, tmp_path, monkeypatch, quant_kl_steps=1, quant_kl_model=str(nvfp4_dir))


# ------------------------------------------------------------------ a format reward a constant answer cannot farm
def test_constant_answer_farms_the_format_reward_but_not_the_gated_one():
    """"Answer: 17" to every prompt, never right: the plain format reward pays it on every item, and a group of it
    is all equal (no gradient out of it); the gated one pays nothing. A correct well-formed answer is paid by both."""
    constant, golds = ["Answer: 17"] * 4, ["3", "12", "25", "8"]
    assert format_reward(constant, style="answer_line") == [1.0] * 4
    gated = get_reward_fn("answer_line_format_if_correct")
    assert call_reward(gated, constant, answers=golds, kind="numeric") == [0.0] * 4
    assert call_reward(gated, ["Answer: 3", "12", "Answer: 25\nmore", "Answer: 9"], answers=golds,
                       kind="numeric") == [1.0, 0.0, -0.5, 0.0]  # correct: as the plain reward; wrong: 0
    think = get_reward_fn("think_format_if_correct")
    assert think(["<think>x</think><answer>17</answer>", "<think>x</think><answer>12</answer>"],
                 answers=["3", "12"], kind="numeric") == [0.0, 1.0]
