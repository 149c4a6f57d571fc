"""Rollouts on the very modules being trained (FP4 base + LoRA + in-place AQN noise): no copy, no sync.

    engine = TorchEngine(model, tokenizer)
    out = engine.generate(prompt_ids, n=8, sampling=SamplingParams(temperature=1.0, max_tokens=256, seed=0))

One call = one batch of len(prompts) * n rows. Each prompt is prefilled once (left-padded batch) and its
KV cache is repeated n times, then all rows decode together. On CPU the cache is a DynamicCache and rows
that finished are dropped from the batch (less work as sequences end); on CUDA a StaticCache keeps shapes
fixed so the decode step can be captured in a CUDA graph via torch.compile(mode="reduce-overhead").
"""
from __future__ import annotations

import collections
import contextlib
import warnings

import torch
from transformers import DynamicCache, StaticCache

from qerl.errors import QerlError
from qerl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams, check_prompts
from qerl.rollout.sampling import StopChecker, row_uniforms, sample_tokens

_STATIC_BUCKET = 128  # static KV length is rounded up to this, bounding CUDA-graph recompilations


class TorchEngine(RolloutEngine):
    """Batched sampling with the model object given (HF causal LM, peft-wrapped or not).

    max_batch_size caps rows (prompts * n) decoded at once; prompts are split into groups to fit.
    cache: "dynamic" (grows; finished rows are dropped), "static" (preallocated; needed for CUDA graphs)
    or "auto" (static on CUDA, dynamic elsewhere). use_cuda_graph: True, False or "auto" (= on CUDA with
    the static cache). eos_token_ids overrides the EOS set read from generation_config and tokenizer.
    """

    def __init__(self, model, tokenizer, *, max_batch_size: int | None = None, use_cuda_graph="auto",
                 cache: str = "auto", eos_token_ids=None):
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise QerlError(f"TorchEngine.max_batch_size: expected None or an int >= 1, got {max_batch_size!r}")
        if cache not in ("auto", "dynamic", "static"):
            raise QerlError(f"TorchEngine.cache: expected 'auto', 'dynamic' or 'static', got {cache!r}")
        if use_cuda_graph not in (True, False, "auto"):
            raise QerlError(f"TorchEngine.use_cuda_graph: expected True, False or 'auto', got {use_cuda_graph!r}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        on_cuda = self.device.type == "cuda"
        self.cache_kind = cache if cache != "auto" else ("static" if on_cuda else "dynamic")
        self.use_cuda_graph = on_cuda and self.cache_kind == "static" and use_cuda_graph in (True, "auto")
        if use_cuda_graph is True and not self.use_cuda_graph:
            raise QerlError("TorchEngine.use_cuda_graph=True needs the model on CUDA and cache='static'|'auto'")
        self.eos_ids = sorted(_eos_ids(model, tokenizer) if eos_token_ids is None else set(eos_token_ids))
        self.pad_id = _pad_id(model, tokenizer, self.eos_ids)
        self.stats = {"prefill_calls": 0, "prefill_rows": 0, "decode_calls": 0}
        self._decode_fn, self._graph_calls = None, collections.Counter()
        self._static = None  # (key, StaticCache) of the last call, reused while shapes match

    # ---------------------------------------------------------------- public API
    def generate(self, prompt_ids, n: int = 1, sampling: SamplingParams | None = None) -> RolloutOutput:
        sampling = sampling or SamplingParams()
        prompts = check_prompts(prompt_ids, n)
        base_seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        group = len(prompts) if self.max_batch_size is None else max(1, self.max_batch_size // n)
        rows: list[tuple[list[int], list[float], str]] = []
        with _inference_mode(self.model):
            for start in range(0, len(prompts), group):
                chunk = prompts[start:start + group]
                rows += self._generate_group(chunk, n, sampling, base_seed, first_row=start * n)
        return RolloutOutput(
            prompt_ids=[p for p in prompts for _ in range(n)],
            completion_ids=[r[0] for r in rows], logprobs=[r[1] for r in rows],
            finish_reasons=[r[2] for r in rows], stats=dict(self.stats))

    def close(self) -> None:
        self._decode_fn, self._graph_calls, self._static = None, collections.Counter(), None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------- one group of prompts
    def _generate_group(self, prompts, n, sampling: SamplingParams, base_seed: int, first_row: int):
        """Prefill the group once, repeat each prompt's cache n times, decode all rows together."""
        ids, mask, pos = _left_pad(prompts, self.pad_id, self.device)
        num_rows, prompt_len, max_new = len(prompts) * n, ids.shape[1], sampling.max_tokens
        # Static caches get a bucketed length so CUDA graphs are reused across calls with other prompt widths
        cache_len = prompt_len + max_new
        cache_len = -(-cache_len // _STATIC_BUCKET) * _STATIC_BUCKET if self.use_cuda_graph else cache_len
        logits, cache = self._prefill(ids, mask, pos, n, cache_len)
        # One attention-mask buffer for the whole call: prompt part repeated per sample, then a column
        # switched on per decoded token. Dynamic caches see a growing view, static ones the full width.
        full_mask = torch.zeros(num_rows, cache_len, dtype=mask.dtype, device=self.device)
        full_mask[:, :prompt_len] = mask.repeat_interleave(n, dim=0)
        pos = pos[:, -1:].repeat_interleave(n, dim=0)
        uniforms = None if sampling.greedy else row_uniforms(
            base_seed, first_row, num_rows, max_new, self.device)
        tokens = torch.full((num_rows, max_new), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(num_rows, max_new, dtype=torch.float32, device=self.device)
        lengths = torch.full((num_rows,), max_new, dtype=torch.long, device=self.device)
        stopped = torch.zeros(num_rows, dtype=torch.bool, device=self.device)
        state = _DecodeState(rows=torch.arange(num_rows, device=self.device), logits=logits,
                             cache=cache, mask=full_mask, pos=pos)
        stop_check = StopChecker(self.tokenizer, sampling.stop, self.eos_ids, self.device)
        finished = 0
        for step in range(max_new):
            u = None if uniforms is None else uniforms[state.rows, step]
            tok, lp = sample_tokens(state.logits, sampling, u)
            tok = tok.masked_fill(state.done, self.pad_id)  # only static caches keep finished rows
            tokens[state.rows, step], logprobs[state.rows, step] = tok, lp
            done = stop_check(tok, tokens, state.rows, step) & ~state.done
            # no boolean indexing here: it would sync with the GPU; the count below is the one sync per step
            lengths[state.rows] = torch.where(done, step + 1, lengths[state.rows])
            stopped[state.rows] = stopped[state.rows] | done
            newly = int(done.sum())
            finished += newly
            if finished == num_rows or step == max_new - 1:
                break
            self._decode_step(state, tok, done, newly, prompt_len + step)
        return _to_rows(tokens, logprobs, lengths, stopped)

    def _prefill(self, ids, mask, pos, n, max_len):
        """Run each prompt once; return next-token logits and a cache holding every row's prompt."""
        dynamic = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=dynamic,
                         use_cache=True, logits_to_keep=1)
        self.stats["prefill_calls"] += 1
        self.stats["prefill_rows"] += ids.shape[0]
        logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)
        if self.cache_kind == "dynamic":
            dynamic.batch_repeat_interleave(n)
            return logits, dynamic
        # Reuse the last static cache when shapes match: CUDA graphs are recorded against its addresses
        key = (ids.shape[0] * n, max_len)
        if self._static is None or self._static[0] != key:
            self._static = (key, StaticCache(config=self.model.config, max_cache_len=max_len))
        return logits, _static_from_dynamic(self._static[1], dynamic, n)

    def _decode_step(self, state, tok, done, newly: int, cache_len: int):
        """Feed the sampled tokens; rows that finished are dropped (dynamic) or fed padding (static)."""
        if self.cache_kind == "static":
            state.done = state.done | done
        elif newly:
            keep = (~done).nonzero().squeeze(1)
            state.cache.batch_select_indices(keep)
            state.rows, state.mask, state.pos, tok = state.rows[keep], state.mask[keep], state.pos[keep], tok[keep]
            state.done = state.done[keep]
        state.mask[:, cache_len] = 1
        state.pos = state.pos + 1
        mask = state.mask if self.cache_kind == "static" else state.mask[:, :cache_len + 1]
        state.logits = self._forward_decode(tok[:, None], mask, state.pos, state.cache)
        self.stats["decode_calls"] += 1

    def _forward_decode(self, tok, mask, pos, cache):
        if self.use_cuda_graph:
            return self._forward_graphed(tok, mask, pos, cache)
        return _decode_forward(self.model, tok, mask, pos, cache)

    def _forward_graphed(self, tok, mask, pos, cache):
        """The decode step through torch.compile(mode="reduce-overhead"), i.e. replayed as a CUDA graph.

        If compiling fails (a module dynamo cannot trace), rollouts go on eagerly: the cache write
        counters are put back first so the eager step lands in the same slot.
        """
        if self._decode_fn is None:
            self._decode_fn = torch.compile(_decode_forward, mode="reduce-overhead", dynamic=False)
        # the graph's output buffer is reused by the next replay: keep a copy
        if self._graph_calls[mask.shape] >= 3:  # compiled, warmed up and captured: no failure expected
            return self._decode_fn(self.model, tok, mask, pos, cache).clone()
        counters = [layer.cumulative_length.clone() for layer in cache.layers]
        try:
            logits = self._decode_fn(self.model, tok, mask, pos, cache).clone()
            self._graph_calls[mask.shape] += 1
            return logits
        except Exception as exc:  # noqa: BLE001 - any compile/capture failure falls back to eager
            warnings.warn(f"TorchEngine: CUDA-graph decode failed ({type(exc).__name__}: {exc}); "
                          "decoding eagerly from now on", RuntimeWarning, stacklevel=2)
            self.use_cuda_graph, self._decode_fn = False, None
            for layer, count in zip(cache.layers, counters):
                layer.cumulative_length.copy_(count)
            return _decode_forward(self.model, tok, mask, pos, cache)


class _DecodeState:
    """The batch being decoded: which output rows it holds, its cache, mask, positions and last logits."""

    def __init__(self, rows, logits, cache, mask, pos):
        self.rows, self.logits, self.cache, self.mask, self.pos = rows, logits, cache, mask, pos
        self.done = torch.zeros_like(rows, dtype=torch.bool)  # stays all False for dynamic caches


def _decode_forward(model, tok, mask, pos, cache):
    out = model(input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    return out.logits[:, -1].float()


def _left_pad(prompts, pad_id: int, device):
    """Left-padded ids, mask and positions exactly as transformers' generate builds them."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return ids.to(device), mask.to(device), pos.to(device)


def _static_from_dynamic(static: StaticCache, dynamic: DynamicCache, n: int) -> StaticCache:
    """Copy the prefilled prompts (repeated n times) into a preallocated cache for static-shape decoding."""
    for src, dst in zip(dynamic.layers, static.layers):
        keys, values = src.keys.repeat_interleave(n, dim=0), src.values.repeat_interleave(n, dim=0)
        if dst.is_initialized:
            dst.reset()
        else:
            dst.lazy_initialization(keys, values)
        dst.update(keys, values)
    return static


def _to_rows(tokens, logprobs, lengths, stopped):
    """One host transfer at the end; rows trimmed to their own length."""
    tokens, logprobs, lengths, stopped = tokens.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist()
    return [(t[:k], lp[:k], "stop" if s else "length") for t, lp, k, s in zip(tokens, logprobs, lengths, stopped)]


def _eos_ids(model, tokenizer) -> set[int]:
    """EOS set = generation_config.eos_token_id (int or list) plus the tokenizer's eos token."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise QerlError("TorchEngine: neither generation_config.eos_token_id nor tokenizer.eos_token_id is set")
    return ids


def _pad_id(model, tokenizer, eos_ids) -> int:
    """Any valid id works (padding is masked); prefer the declared pad token, as generate does."""
    for pad in (getattr(tokenizer, "pad_token_id", None),
                getattr(getattr(model, "generation_config", None), "pad_token_id", None), *eos_ids, 0):
        if isinstance(pad, int):
            return pad
    return 0


@contextlib.contextmanager
def _inference_mode(model):
    """eval() for the call (no dropout, no gradient checkpointing), each module's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        for m, training in modes:
            m.training = training
