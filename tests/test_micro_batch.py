"""The update's micro-batches are cut to their own longest completion, with the log-probs of the uncut rows."""
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
