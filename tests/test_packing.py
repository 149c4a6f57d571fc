"""Padding-free (packed) log-probs equal the padded ones: values, entropies and LoRA gradients in float64, with and
without gradient checkpointing; a backward outside the packed scope fails loudly; the GPU's flash varlen path
against the padded path in bf16."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from qerl.errors import QerlError
from qerl.grpo import token_logprobs
from qerl.packing import NAME, packed_attention, packed_token_logprobs, packing_possible, unsupported_reason


def _rows(prompts, completions, pad=0):
    """TRL's layout: left-padded prompts, right-padded completions."""
    plen, clen = max(prompts), max(completions)
    gen = torch.Generator().manual_seed(sum(prompts) + 7 * sum(completions))
    ids = torch.full((len(prompts), plen + clen), pad)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, plen - p:plen + c] = torch.randint(10, 1000, (p + c,), generator=gen)
        mask[i, plen - p:plen + c] = 1
    return ids, mask, clen


def _model(tiny_model_dir, dtype=torch.float64, checkpointing=False):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            init_lora_weights=False))
    model.train()
    return model


def _grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_equals_padded_in_float64(tiny_model_dir, checkpointing):
    model = _model(tiny_model_dir, checkpointing=checkpointing)
    ids, mask, keep = _rows([5, 11, 8, 1], [6, 2, 9, 0])  # a row of one prompt token; a row with no completion
    comp = mask[:, -keep:].bool()
    weights = torch.rand(comp.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    lp_ref, ent_ref = token_logprobs(model, ids, mask, keep, temperature=0.7, chunk_size=5)
    (lp_ref * weights * comp).sum().backward()
    ref = _grads(model)

    lp, ent = packed_token_logprobs(model, ids, mask, keep, temperature=0.7, chunk_size=5)
    with packed_attention(model):
        (lp * weights * comp).sum().backward()
    got = _grads(model)

    torch.testing.assert_close(lp[comp], lp_ref[comp], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent[comp], ent_ref[comp], rtol=1e-10, atol=1e-10)
    assert (lp[~comp] == 0).all() and (ent[~comp] == 0).all()  # pad positions hold zeros, not stale values
    assert model.config._attn_implementation != NAME  # the scope put the configured implementation back
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-12)
    assert sum(float(g.abs().sum()) for g in ref.values()) > 0


def test_rows_do_not_see_each_other(tiny_model_dir):
    """A row's log-probs do not change when its neighbours in the packed sequence change."""
    model = _model(tiny_model_dir)
    ids, mask, keep = _rows([4, 7, 6], [5, 3, 8])
    with torch.no_grad():
        first, _ = packed_token_logprobs(model, ids, mask, keep)
        other = ids.clone()
        other[0] = torch.where(mask[0].bool(), (other[0] + 17) % 1000 + 10, other[0])
        other[2] = torch.where(mask[2].bool(), (other[2] + 29) % 1000 + 10, other[2])
        second, _ = packed_token_logprobs(model, other, mask, keep)
    torch.testing.assert_close(second[1], first[1], rtol=0, atol=1e-12)
    assert not torch.allclose(second[0], first[0])  # the changed rows did change


def test_backward_outside_the_scope_fails_under_checkpointing(tiny_model_dir):
    model = _model(tiny_model_dir, checkpointing=True)
    ids, mask, keep = _rows([5, 9], [4, 3])
    lp, _ = packed_token_logprobs(model, ids, mask, keep)
    with pytest.raises(QerlError, match="packed_attention"):
        lp.sum().backward()


def test_unpacked_calls_in_the_scope_use_the_models_attention(tiny_model_dir):
    """Inside the scope a padded forward (no row bounds) runs the configured implementation: same log-probs."""
    model = _model(tiny_model_dir)
    ids, mask, keep = _rows([3, 8], [5, 2])
    with torch.no_grad():
        ref, _ = token_logprobs(model, ids, mask, keep)
        with packed_attention(model):
            inside, _ = token_logprobs(model, ids, mask, keep)
    torch.testing.assert_close(inside, ref, rtol=0, atol=0)


def test_bad_rows_and_models_fail_in_one_line(tiny_model_dir):
    model = _model(tiny_model_dir)
    ids, mask, keep = _rows([3, 4], [2, 2])
    mask[1, :-keep] = 0  # a row whose prompt is all padding
    with pytest.raises(QerlError, match="without a prompt token"):
        packed_token_logprobs(model, ids, mask, keep)
    with pytest.raises(QerlError, match="logits_to_keep"):
        packed_token_logprobs(model, ids, mask, ids.shape[1])
    assert unsupported_reason(model) is None
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in unsupported_reason(model)
    model.config._attn_implementation = "sdpa"
    model.config.attention_dropout = 0.1
    assert "attention_dropout" in unsupported_reason(model)
    model.config.attention_dropout = 0.0
    assert packing_possible(model, True) and not packing_possible(model, False)
    model.config.layer_types = ["sliding_attention"] * len(model.config.layer_types)
    assert "sliding_attention" in unsupported_reason(model)
    assert not packing_possible(model, True)  # the trainer then pads its rows (logged)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True])
def test_flash_varlen_matches_padded_on_gpu(tiny_model_dir, checkpointing, monkeypatch):
    """bf16 on CUDA: flash's varlen kernel (checked to run) against the padded SDPA path and a float64 reference."""
    import qerl.packing as packing

    seen = []
    flash = packing._flash_rows
    monkeypatch.setattr(packing, "_flash_rows", lambda *a: seen.append(a[0].shape) or flash(*a))
    ids, mask, keep = _rows([37, 120, 5, 64, 90], [200, 17, 150, 0, 96])
    comp = mask[:, -keep:].bool()
    exact = _model(tiny_model_dir, torch.float64)
    with torch.no_grad():
        want, _ = token_logprobs(exact, ids, mask, keep)
    model = _model(tiny_model_dir, torch.bfloat16, checkpointing).cuda()
    ids, mask = ids.cuda(), mask.cuda()
    weights = comp.cuda().float()  # the padded path also scores pad positions: only real tokens count
    padded, _ = token_logprobs(model, ids, mask, keep)
    (padded.float() * weights).sum().backward()
    ref = _grads(model)
    packed, _ = packed_token_logprobs(model, ids, mask, keep)
    with packed_attention(model):
        (packed.float() * weights).sum().backward()
    got = _grads(model)
    assert seen, "the flash varlen path did not run"
    _assert_as_near(packed, got, padded, ref, want, comp)


def _assert_as_near(lp, grads, plain_lp, plain_grads, want, comp):
    """bf16 log-probs within twice the plain rows' error of the float64 ones (+1e-3) at real completion tokens,
    and every gradient in the plain rows' direction (cosine > 0.99)."""
    err = (lp.double().cpu() - want)[comp].abs().max()
    err_plain = (plain_lp.double().cpu() - want)[comp].abs().max()
    assert err <= 2 * err_plain + 1e-3, (err, err_plain)
    for name, grad in plain_grads.items():
        cos = torch.nn.functional.cosine_similarity(grads[name].double().flatten(), grad.double().flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))


def test_true_positions_without_a_host_read():
    """The set entries' positions, in order, as nonzero gives them; none set and all set included."""
    from qerl.packing import _true_positions

    gen = torch.Generator().manual_seed(5)
    cases = (torch.rand(97, generator=gen) < 0.3, torch.zeros(5, dtype=torch.bool), torch.ones(6, dtype=torch.bool))
    for flags in cases:
        want = flags.nonzero().squeeze(1)
        assert torch.equal(_true_positions(flags, int(flags.sum())), want)


def _groups(prompts, completions, g):
    """Left-padded prompts (P, Lp) and right-padded completions (P * G, Lc), row i * G + j of prompt i."""
    gen = torch.Generator().manual_seed(11)
    plen, clen = max(prompts), max(completions)
    p_ids, p_mask = torch.zeros(len(prompts), plen, dtype=torch.long), torch.zeros(len(prompts), plen, dtype=torch.long)
    for i, n in enumerate(prompts):
        p_ids[i, plen - n:], p_mask[i, plen - n:] = torch.randint(10, 1000, (n,), generator=gen), 1
    c_ids = torch.zeros(len(completions), clen, dtype=torch.long)
    c_mask = torch.zeros_like(c_ids)
    for i, n in enumerate(completions):
        c_ids[i, :n], c_mask[i, :n] = torch.randint(10, 1000, (n,), generator=gen), 1
    assert len(completions) == g * len(prompts)
    return p_ids, p_mask, c_ids, c_mask


@pytest.mark.parametrize("checkpointing", [False, True])
def test_grouped_packed_equals_plain_rows_in_float64(tiny_model_dir, checkpointing, float64_norms):
    """Each prompt once, its K/V read by its G completions: the log-probs, entropies and LoRA gradients of the
    plain padded rows (prompt repeated per row), with and without gradient checkpointing; an empty completion."""
    from qerl.packing import grouped_packed_token_logprobs

    g = 3
    p_ids, p_mask, c_ids, c_mask = _groups([5, 9], [4, 1, 7, 0, 6, 2], g)
    ids = torch.cat([p_ids.repeat_interleave(g, 0), c_ids], 1)
    mask = torch.cat([p_mask.repeat_interleave(g, 0), c_mask], 1)
    comp = c_mask.bool()
    weights = torch.rand(comp.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    model = _model(tiny_model_dir, checkpointing=checkpointing)
    lp_ref, ent_ref = token_logprobs(model, ids, mask, c_ids.shape[1], temperature=0.8, chunk_size=4)
    (lp_ref * weights * comp).sum().backward()
    ref = _grads(model)
    lp, ent = grouped_packed_token_logprobs(model, p_ids, p_mask, c_ids, c_mask, g, temperature=0.8, chunk_size=4)
    with packed_attention(model):
        (lp * weights * comp).sum().backward()
    got = _grads(model)
    torch.testing.assert_close(lp[comp], lp_ref[comp], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent[comp], ent_ref[comp], rtol=1e-10, atol=1e-10)
    assert (lp[~comp] == 0).all()
    for name, grad in ref.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-9, atol=1e-12)
    assert sum(float(x.abs().sum()) for x in ref.values()) > 0


def test_grouped_packed_rows_see_only_their_own_prompt_and_completion(tiny_model_dir):
    from qerl.packing import grouped_packed_token_logprobs

    model = _model(tiny_model_dir)
    p_ids, p_mask, c_ids, c_mask = _groups([6, 4], [5, 3, 4, 6], 2)
    with torch.no_grad():
        first, _ = grouped_packed_token_logprobs(model, p_ids, p_mask, c_ids, c_mask, 2)
        other_c = c_ids.clone()
        other_c[1] = torch.where(c_mask[1].bool(), (c_ids[1] + 13) % 900 + 10, c_ids[1])  # row 0's group mate
        other_p = p_ids.clone()
        other_p[1] = torch.where(p_mask[1].bool(), (p_ids[1] + 7) % 900 + 10, p_ids[1])  # the other group's prompt
        second, _ = grouped_packed_token_logprobs(model, other_p, p_mask, other_c, c_mask, 2)
    torch.testing.assert_close(second[0], first[0], rtol=0, atol=1e-12)
    assert not torch.allclose(second[2], first[2]) and not torch.allclose(second[1], first[1])


def test_no_completion_token_falls_back_to_the_padded_rows(tiny_model_dir):
    from qerl.packing import grouped_packed_token_logprobs

    model = _model(tiny_model_dir)
    ids, mask, keep = _rows([4, 6], [1, 1])
    mask[:, -keep:] = 0  # every completion empty: one padded column
    lp, _ = packed_token_logprobs(model, ids, mask, keep)
    assert lp.shape == (2, keep) and lp.requires_grad
    p_ids, p_mask, c_ids, c_mask = _groups([3, 5], [1, 1, 1, 1], 2)
    c_mask[:] = 0
    lp, _ = grouped_packed_token_logprobs(model, p_ids, p_mask, c_ids, c_mask, 2)
    assert lp.shape == (4, 1) and lp.requires_grad


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True])
def test_grouped_flash_rows_match_float64_on_gpu(tiny_model_dir, checkpointing, monkeypatch):
    """bf16 on CUDA: completions reading their prompt's K/V through flash's varlen kernel (more keys than queries:
    the causal mask aligned to the last key) against the plain rows in float64, and their gradients against the
    plain bf16 rows'."""
    import qerl.packing as packing

    seen = []
    flash = packing._flash_rows
    monkeypatch.setattr(packing, "_flash_rows", lambda *a: seen.append(a[0].shape[0] != a[1].shape[0]) or flash(*a))
    g = 4
    p_ids, p_mask, c_ids, c_mask = _groups([37, 120], [200, 17, 150, 0, 96, 64, 5, 180], g)
    ids = torch.cat([p_ids.repeat_interleave(g, 0), c_ids], 1)
    mask = torch.cat([p_mask.repeat_interleave(g, 0), c_mask], 1)
    comp = c_mask.bool()
    with torch.no_grad():
        want, _ = token_logprobs(_model(tiny_model_dir, torch.float64), ids, mask, c_ids.shape[1])
    model = _model(tiny_model_dir, torch.bfloat16, checkpointing).cuda()
    weights = comp.cuda().float()
    plain, _ = token_logprobs(model, ids.cuda(), mask.cuda(), c_ids.shape[1])
    (plain.float() * weights).sum().backward()
    ref = _grads(model)
    grouped, _ = packing.grouped_packed_token_logprobs(model, p_ids.cuda(), p_mask.cuda(), c_ids.cuda(),
                                                       c_mask.cuda(), g)
    with packed_attention(model):
        (grouped.float() * weights).sum().backward()
    got = _grads(model)
    assert True in seen, "no flash call read a prompt's keys"
    _assert_as_near(grouped, got, plain, ref, want, comp)


def test_positions_computed_in_each_layout():
    """Padded rows compute every position, packed ones their real tokens; shared prompts count once per group."""
    from qerl.packing import positions_computed

    ids, mask, keep = _rows([3, 5, 2, 4], [2, 4, 1, 3])  # 4 rows of 5 + 4 positions, 14 + 10 real tokens
    assert positions_computed(mask, keep, packed=False) == 4 * 9
    assert positions_computed(mask, keep, packed=True) == 24
    assert positions_computed(mask, keep, packed=False, group=2) == 2 * 5 + 4 * 4
    assert positions_computed(mask, keep, packed=True, group=2) == (3 + 2) + 10  # rows 0 and 2 hold the prompts


def test_shared_prompts_need_whole_groups_per_micro_batch():
    """train.padding_free shared_prompts with micro-batches that split groups fails in one line at parse time
    (it would otherwise fall back to packed rows without sharing, unsaid)."""
    from qerl.config import parse_section

    base = {"data": {"source": "x.jsonl"}, "num_generations": 8, "batch_size": 8, "padding_free": "shared_prompts"}
    with pytest.raises(QerlError, match="padding_free shared_prompts needs micro_batch_size a multiple"):
        parse_section("train", {**base, "micro_batch_size": 4})
    assert parse_section("train", {**base, "micro_batch_size": 16}).padding_free == "shared_prompts"


@pytest.mark.parametrize("padding_free,micro,checkpointing,expected", [
    ("auto", 16, True, True), ("auto", 12, True, False), ("auto", 16, False, False), (True, 16, True, False),
    (False, 16, True, False), ("shared_prompts", 16, False, True)])
def test_which_configs_share_prompts_in_packed_rows(padding_free, micro, checkpointing, expected):
    """auto (the default) shares each prompt in packed rows where micro-batches hold whole groups (G = 8 here) and
    checkpointing keeps the KV-cache path out; shared_prompts always; true and false never."""
    from qerl.config import parse_section
    from qerl.packing import shares_prompts

    cfg = parse_section("train", {"data": {"source": "x.jsonl"}, "num_generations": 8, "batch_size": 24,
                                  "micro_batch_size": micro, "gradient_checkpointing": checkpointing,
                                  "padding_free": padding_free})
    assert shares_prompts(cfg) is expected
