"""PagedEngine with a rollout's dense copies of the FP4 weights: same rows as without, given back by sleep()."""
from __future__ import annotations

import pytest
import torch

from qerl.errors import QerlError
from qerl.quant.linear import DENSE_COPY_MIN_ROWS, FP4Linear
from qerl.rollout import SamplingParams
from qerl.rollout.paged_engine import PagedEngine

from tests.rollout.test_paged_engine import fp4_lora_model, model_state, same_rows

from tests.rollout.conftest import TEXTS  # the three prompts every rollout test decodes


def _copies(model) -> int:
    return sum("dense_copy" in m.__dict__ for m in model.modules() if isinstance(m, FP4Linear))


def _run(nvfp4_dir, tiny_model_dir, device, **engine_kw):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = fp4_lora_model(nvfp4_dir, adapter_dtype=torch.float32).to(device)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    n = -(-DENSE_COPY_MIN_ROWS // len(prompts))  # decode steps of >= DENSE_COPY_MIN_ROWS rows
    params = SamplingParams(temperature=0, max_tokens=5)
    return model, tok, prompts, n, params


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dense_copies_give_the_rows_of_the_fp4_path_and_go_back_on_sleep(nvfp4_dir, tiny_model_dir, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, tok, prompts, n, params = _run(nvfp4_dir, tiny_model_dir, device)
    before = model_state(model)
    kw = dict(block_size=4, eos_token_ids=(), fuse_projections=True, decode_buckets=True)
    ref = PagedEngine(model, tok, dense_weights=False, **kw).generate(prompts, n, params)
    assert ref.stats["dense_copy_bytes"] == 0
    engine = PagedEngine(model, tok, dense_weights=True, **kw)
    calls = []
    layer = next(m for m in model.modules() if isinstance(m, FP4Linear))
    hook = layer.register_forward_hook(lambda mod, args, out: calls.append(mod.dense_copy_for(args[0]) is not None))
    out = engine.generate(prompts, n, params)
    hook.remove()
    same_rows(out, ref, atol=1e-4)
    assert out.stats["dense_copy_bytes"] > 0 and _copies(model) > 0 and any(calls)
    again = engine.generate(prompts, n, params)  # no sleep between: the same copies, graphs reused
    same_rows(again, ref, atol=1e-4)
    engine.sleep()
    assert _copies(model) == 0 and engine.dense_bytes == 0 and model_state(model) == before
    engine.close()


def test_auto_on_cpu_keeps_copies_while_host_memory_allows_and_bad_value_is_refused(nvfp4_dir, tiny_model_dir,
                                                                                     monkeypatch):
    import qerl.quant.dense_copies as dense_mod

    model, tok, prompts, n, params = _run(nvfp4_dir, tiny_model_dir, "cpu")
    engine = PagedEngine(model, tok, eos_token_ids=())
    out = engine.generate(prompts, n, params)
    assert out.stats["dense_copy_bytes"] == out.stats["dense_check_need"] > 0 and _copies(model) > 0
    assert out.stats["dense_check_kept"] is True and out.stats["dense_check_free"] > 0  # the decision is reported
    engine.release()
    assert _copies(model) == 0
    monkeypatch.setattr(dense_mod, "available_host_bytes", lambda: out.stats["dense_check_need"])  # < 4x the need
    out = PagedEngine(model, tok, eos_token_ids=()).generate(prompts, n, params)
    assert out.stats["dense_copy_bytes"] == 0 and _copies(model) == 0 and out.stats["dense_check_kept"] is False
    with pytest.raises(QerlError, match="dense_weights"):
        PagedEngine(model, tok, dense_weights="yes")
