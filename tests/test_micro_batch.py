"""The update's micro-batches are cut to their own longest completion, with the log-probs of the uncut rows."""
import pytest
import torch

from qerl.grpo import token_logprobs
from qerl.trainer import Batch, micro_batch


def _batch(lengths, plen=3, width=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    ids = torch.randint(5, 200, (rows, plen + width), generator=gen)
    attn = torch.zeros(rows, plen + width, dtype=torch.long)
    attn[:, 1:plen] = 1  # a left-padded prompt
    comp = torch.zeros(rows, width)
    for r, n in enumerate(lengths):
        attn[r, plen:plen + n] = 1
        comp[r, :n] = 1
    ids[attn == 0] = 0
    return Batch(input_ids=ids, attention_mask=attn, completion_mask=comp,
                 rollout_logprobs=torch.randn(rows, width, generator=gen), advantages=torch.randn(rows, generator=gen))


def test_cut_to_the_longest_completion_of_the_rows():
    batch = _batch([2, 5, 9, 1])
    sub = micro_batch(batch, slice(0, 2))
    assert sub.completion_len == 5 and sub.input_ids.shape == (2, 8)
    assert torch.equal(sub.input_ids, batch.input_ids[:2, :8]) and torch.equal(sub.advantages, batch.advantages[:2])
    assert torch.equal(sub.rollout_logprobs, batch.rollout_logprobs[:2, :5])
    assert micro_batch(batch, slice(2, 4)).completion_len == 9
    empty = _batch([0, 0])
    assert micro_batch(empty, slice(0, 2)).completion_len == 1  # a batch of empty completions keeps one column


def test_cut_rows_have_the_log_probs_of_the_whole_width(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    batch = _batch([2, 5, 4, 1])
    rows = slice(0, 3)
    full, _ = token_logprobs(model, batch.input_ids[rows], batch.attention_mask[rows], batch.completion_len)
    sub = micro_batch(batch, rows)
    cut, _ = token_logprobs(model, sub.input_ids, sub.attention_mask, sub.completion_len)
    mask = sub.completion_mask.bool()
    torch.testing.assert_close(cut[mask], full[:, :sub.completion_len][mask], rtol=1e-10, atol=1e-10)


def test_rows_ordered_by_length_in_whole_units_longest_first():
    from bench.paged import draw_lengths
    from qerl.trainer import micro_batch_rows

    batch = _batch([2, 5, 9, 1, 3, 3, 0, 7])
    parts = micro_batch_rows(batch, 2)
    assert [p.tolist() for p in parts] == [[2, 7], [1, 4], [5, 0], [3, 6]]  # 9 7 | 5 3 | 3 2 | 1 0 (stable ties)
    groups = micro_batch_rows(batch, 4, unit=2)  # units (0,1) max 5, (2,3) 9, (4,5) 3, (6,7) 7
    assert [p.tolist() for p in groups] == [[2, 3, 6, 7], [0, 1, 4, 5]]
    assert [p.tolist() for p in micro_batch_rows(batch, 4, by_length=False)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [p.tolist() for p in micro_batch_rows(batch, 8)] == [list(range(8))]  # one micro-batch: as it came
    # RL's long-tailed lengths: padded tokens of 16-row micro-batches vs the real ones
    lengths = draw_lengths(1024, 400, 0.6, 4096, 0)
    long = _batch(lengths, plen=4, width=max(lengths))

    def padded(parts):
        return sum(len(p) * micro_batch(long, p).completion_len for p in parts) / sum(lengths)

    assert padded(micro_batch_rows(long, 16)) < 1.05 < 1.8 < padded(micro_batch_rows(long, 16, by_length=False))


def _grads(tiny_model_dir, tmp_path, batch, monkeypatch, *, by_length, loss_type, checkpointing, padding_free=True):
    from bench.e2e_workers import _random_reward
    from qerl import trainer as trainer_module
    from qerl.config import TrainConfig
    from qerl.policy import LoraSpec, load_policy

    torch.manual_seed(0)
    model, tok = load_policy(tiny_model_dir, mode="lora", dtype=torch.float64, device="cpu",
                             lora=LoraSpec(r=2, alpha=4), gradient_checkpointing=checkpointing)
    model.double()  # float64 throughout: what is left of a difference is the loss, not rounding
    for name, p in model.named_parameters():  # B starts at zero: give the adapter a gradient through both factors
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(1))
    cfg = TrainConfig(mode="lora", data={"source": "bench"}, rewards=["bench.e2e_workers:_random_reward"],
                      num_generations=2, batch_size=4, micro_batch_size=2, max_steps=1, max_completion_length=9,
                      aqn=None, lora={"lora_r": 2, "lora_alpha": 4}, dtype="float32", loss_type=loss_type,
                      gradient_checkpointing=checkpointing, max_grad_norm=1e9, padding_free=padding_free)
    trainer = trainer_module.GRPOTrainer(cfg, model, tok, [[5, 6]] * 4, ["0"] * 4, [("random", _random_reward, 1.0)],
                                         checkpoint_dir=tmp_path)
    seen = []
    original = trainer_module.micro_batch_rows

    def rows(*args, **kwargs):
        parts = original(*args, **{**kwargs, "by_length": by_length and kwargs.get("by_length", True)})
        seen.append([p.tolist() for p in parts])
        return parts

    monkeypatch.setattr(trainer_module, "micro_batch_rows", rows)
    monkeypatch.setattr(trainer.optimizer, "step", lambda *a, **k: None)  # keep the accumulated gradient
    monkeypatch.setattr(trainer.optimizer, "zero_grad", lambda *a, **k: None)
    metrics = trainer.update(batch, 0)
    g = cfg.num_generations if trainer.share_prefix else 1  # prompts computed once per group of g rows

    def positions(p):  # every prompt of _batch holds 2 real tokens
        sub = micro_batch(batch, p)
        rows, width, clen = len(p), sub.input_ids.shape[1], sub.completion_len
        if not trainer.packable:
            return rows * width - (rows - rows // g) * (width - clen)
        return int(sub.attention_mask.sum()) - (rows - rows // g) * 2

    computed = sum(positions(p) for p in seen[0])
    # without checkpointing each prompt is computed once per group over a KV cache, unless packed with its group
    # auto: in packed rows under checkpointing (groups are whole here), else over the KV cache like True
    shared = padding_free == "shared_prompts" or (padding_free == "auto" and checkpointing)
    packed = shared or bool(padding_free and checkpointing)
    assert trainer.packable == packed and trainer.prompts_packed == shared
    assert metrics["update/padded_tokens_ratio"] == pytest.approx(computed / float(batch.attention_mask.sum()))
    assert (metrics["update/padded_tokens_ratio"] == 1.0) == (packed and g == 1)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, seen[0]


@pytest.mark.parametrize("loss_type,checkpointing", [("dapo", True), ("grpo", True), ("dr_grpo", False),
                                                     ("dapo", False)])
def test_length_ordered_micro_batches_give_the_consecutive_gradient(tiny_model_dir, tmp_path, monkeypatch,
                                                                    loss_type, checkpointing):
    batch = _batch([2, 9, 1, 8, 3, 7, 9, 1])
    ordered, parts = _grads(tiny_model_dir, tmp_path / "a", batch, monkeypatch, by_length=True,
                            loss_type=loss_type, checkpointing=checkpointing)
    plain, consecutive = _grads(tiny_model_dir, tmp_path / "b", batch, monkeypatch, by_length=False,
                                loss_type=loss_type, checkpointing=checkpointing)
    assert consecutive == [[0, 1], [2, 3], [4, 5], [6, 7]] and parts != consecutive  # other rows went together
    assert ordered.keys() == plain.keys() and len(ordered) > 0
    for name in ordered:  # sums in another order: relative to the tensor's norm, not elementwise
        scale = plain[name].norm()
        assert scale > 0 and (ordered[name] - plain[name]).norm() / scale < 1e-10, name


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_packed_update_gives_the_padded_gradient(tiny_model_dir, tmp_path, monkeypatch, loss_type):
    """train.padding_free: a whole trainer update (log-probs, loss, backward through checkpointed layers) over
    packed rows has the padded update's gradient, in float64."""
    batch = _batch([2, 9, 1, 8, 3, 7, 9, 1])
    packed, _ = _grads(tiny_model_dir, tmp_path / "a", batch, monkeypatch, by_length=True, loss_type=loss_type,
                       checkpointing=True)
    padded, _ = _grads(tiny_model_dir, tmp_path / "b", batch, monkeypatch, by_length=True, loss_type=loss_type,
                       checkpointing=True, padding_free=False)
    assert packed.keys() == padded.keys() and len(packed) > 0
    for name in packed:
        scale = padded[name].norm()
        assert scale > 0 and (packed[name] - padded[name]).norm() / scale < 1e-10, name


@pytest.mark.parametrize("checkpointing,padding_free", [(True, "shared_prompts"), (False, "shared_prompts"),
                                                        (True, "auto"), (False, "auto")])
def test_shared_prompt_update_gives_the_padded_gradient(tiny_model_dir, tmp_path, monkeypatch, checkpointing,
                                                        padding_free, float64_norms):
    """train.padding_free shared_prompts (and auto, the default, with whole groups): each prompt computed once per
    group in packed rows, also under gradient checkpointing (where the KV-cache path cannot run; auto without it
    takes the KV cache); a whole update has the padded rows' gradient."""
    batch = _batch([2, 9, 1, 8, 3, 7, 9, 1])
    batch.input_ids[1::2, :3] = batch.input_ids[0::2, :3]  # G = 2 samples of each prompt
    shared, parts = _grads(tiny_model_dir, tmp_path / "a", batch, monkeypatch, by_length=True, loss_type="dapo",
                           checkpointing=checkpointing, padding_free=padding_free)
    padded, _ = _grads(tiny_model_dir, tmp_path / "b", batch, monkeypatch, by_length=True, loss_type="dapo",
                       checkpointing=True, padding_free=False)
    assert all(len(p) == 2 and p[0] // 2 == p[1] // 2 for p in parts)  # whole groups (G = 2) per micro-batch
    for name in padded:
        scale = padded[name].norm()
        assert scale > 0 and (shared[name] - padded[name]).norm() / scale < 1e-10, name


def test_bnpo_keeps_its_rows_as_they_came(tiny_model_dir, tmp_path, monkeypatch):
    _, parts = _grads(tiny_model_dir, tmp_path, _batch([2, 9, 1, 8, 3, 7, 9, 1]), monkeypatch, by_length=True,
                      loss_type="bnpo", checkpointing=True)
    assert parts == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_row_indices_live_on_the_batchs_device():
    """The update's batch is on the GPU: the ordered indices must be built there (a CPU arange does not mix with
    CUDA tensors); the meta device stands in for CUDA on CPU-only machines, as strict about mixing."""
    from qerl.trainer import micro_batch_rows

    cpu = _batch([2, 5, 9, 1, 3, 3, 0, 7])
    names = ("input_ids", "attention_mask", "completion_mask", "rollout_logprobs", "advantages")
    meta = Batch(**{name: getattr(cpu, name).to("meta") for name in names})
    for unit, by_length in ((1, True), (2, True), (1, False)):
        parts = micro_batch_rows(meta, 2, unit=unit, by_length=by_length)
        assert len(parts) == 4 and all(p.device.type == "meta" and p.shape == (2,) for p in parts)
