"""Rollouts on the very modules being trained (FP4 base + LoRA + in-place AQN noise): no copy, no sync.

    engine = TorchEngine(model, tokenizer)
    out = engine.generate(prompt_ids, n=8, sampling=SamplingParams(temperature=1.0, max_tokens=256, seed=0))

One call = one batch of len(prompts) * n rows. Each prompt is prefilled once (left-padded batch) and its
KV cache is repeated n times, then all rows decode together. On CPU the cache is a DynamicCache and rows
that finished are dropped from the batch (less work as sequences end). On CUDA a StaticCache keeps shapes
fixed and one whole decode step - feed the last token, forward (torch.compile'd, so pointwise ops fuse), sample,
record token / log-prob / EOS - runs on the GPU from preallocated buffers, captured once as a CUDA graph and
replayed: the host launches one graph per token and reads back one flag every _SYNC_EVERY steps. A static group
that cannot fit the GPU's free memory is refused in one line before anything is allocated (`check_static_fits`).
"""
from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache

from qerl.errors import QerlError
from qerl.quant.grouped import group_projections, projections_fused, ungroup_projections
from qerl.quant.dense_copies import cpu_dense_copies
from qerl.quant.kernels import humming_fp4
from qerl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams, check_prompts
from qerl.rollout.kv_pool import expandable_segments
from qerl.rollout.lora_shadows import lora_in_dtype
from qerl.rollout.model_state import (compile_options, compute_dtype, eos_ids, inference_mode, model_signature,
                                      pad_id)
from qerl.rollout.sampling import StopChecker, row_uniforms, sample_tokens, sampling_key
from qerl.rollout.static_decoder import (WARMUP_STEPS, StaticDecoder, check_static_fits, free_memory_bytes,
                                         static_cache_bytes)

_STATIC_BUCKET = 128  # static KV length is rounded up to this, bounding CUDA-graph recaptures
_SYNC_EVERY = 16  # static decode checks "all rows finished" on the host every this many steps (no stop strings)


class TorchEngine(RolloutEngine):
    """Batched sampling with the model object given (HF causal LM, peft-wrapped or not).

    max_batch_size caps rows (prompts * n) decoded at once; prompts are split into groups to fit.
    cache: "dynamic" (grows; finished rows are dropped), "static" (preallocated; needed for CUDA graphs)
    or "auto" (static on CUDA, dynamic elsewhere). use_cuda_graph: True, False or "auto" (= on CUDA with
    the static cache). compile: torch.compile the decode forward inside the graph (True, False, or "auto" = with
    CUDA graphs). eos_token_ids overrides the EOS set read from generation_config and tokenizer.
    lora_dtype: LoRA adapter weights kept in another dtype than the model computes in (peft upcasts them to fp32
    for training) are used in this dtype during a call, through copies refreshed at every call ("auto" = the
    model's compute dtype on CUDA, None = as they are): rollouts then run LoRA on bf16 tensor cores like vLLM.
    fuse_projections: LoRA layers that read the same input (q/k/v, gate/up) run as one launch during calls
    (qerl.quant.grouped; the model stays trainable as before). "auto": FP4 and dense (peft LoRA over nn.Linear)
    layers on CUDA, none on CPU; True: both kinds on any device; False: none. Measured gain: BENCHMARKS.md,
    "(b) Rollout", engine choices. plain_projections: frozen layers without adapters (a checkpoint's) are stacked
    too (False: LoRA layers only; the trainer's rollouts, whose weights training owns).
    """

    def __init__(self, model, tokenizer, *, max_batch_size: int | None = None, use_cuda_graph="auto",
                 cache: str = "auto", eos_token_ids=None, compile="auto", lora_dtype="auto",
                 fuse_projections="auto", plain_projections=True):
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise QerlError(f"TorchEngine.max_batch_size: expected None or an int >= 1, got {max_batch_size!r}")
        if cache not in ("auto", "dynamic", "static"):
            raise QerlError(f"TorchEngine.cache: expected 'auto', 'dynamic' or 'static', got {cache!r}")
        if use_cuda_graph not in (True, False, "auto"):
            raise QerlError(f"TorchEngine.use_cuda_graph: expected True, False or 'auto', got {use_cuda_graph!r}")
        if compile not in (True, False, "auto"):
            raise QerlError(f"TorchEngine.compile: expected True, False or 'auto', got {compile!r}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        expandable_segments(self.device)  # the update's leftovers must not pin the next rollout's cache
        on_cuda = self.device.type == "cuda"
        self.cache_kind = cache if cache != "auto" else ("static" if on_cuda else "dynamic")
        self.use_cuda_graph = on_cuda and self.cache_kind == "static" and use_cuda_graph in (True, "auto")
        if use_cuda_graph is True and not self.use_cuda_graph:
            raise QerlError("TorchEngine.use_cuda_graph=True needs the model on CUDA and cache='static'|'auto'")
        self.use_compile = compile is True or (compile == "auto" and self.use_cuda_graph)
        self.eos_ids = sorted(eos_ids(model, tokenizer) if eos_token_ids is None else set(eos_token_ids))
        self.pad_id = pad_id(model, tokenizer, self.eos_ids)
        self.stats = {"prefill_calls": 0, "prefill_rows": 0, "decode_calls": 0, "graph_captures": 0,
                      "graph_replays": 0}
        self._forward = None  # the (compiled) decode forward, built on first use
        self._decoder = None  # the StaticDecoder of the last call, reused while its key matches
        self._stop_after = None  # decode steps a warm_up call runs (None: to max_tokens)
        if lora_dtype not in (None, "auto") and not isinstance(lora_dtype, torch.dtype):
            raise QerlError(f"TorchEngine.lora_dtype: expected None, 'auto' or a torch.dtype, got {lora_dtype!r}")
        self.lora_dtype = (compute_dtype(model) if on_cuda else None) if lora_dtype == "auto" else lora_dtype
        self._shadows: dict[int, torch.nn.Parameter] = {}  # id(adapter weight) -> its copy in lora_dtype
        if fuse_projections not in (True, False, "auto"):
            raise QerlError(f"TorchEngine.fuse_projections: expected True, False or 'auto', got {fuse_projections!r}")
        self._groups: list = []
        self.stats["projection_groups"] = 0
        if plain_projections not in (True, False):
            raise QerlError(f"TorchEngine.plain_projections: expected True or False, got {plain_projections!r}")
        self.plain_projections = plain_projections
        if fuse_projections is True or (fuse_projections == "auto" and on_cuda):
            self.fuse_projections(("fp4", "dense"))

    # ---------------------------------------------------------------- public API
    def generate(self, prompt_ids, n: int = 1, sampling: SamplingParams | None = None) -> RolloutOutput:
        sampling = sampling or SamplingParams()
        prompts = check_prompts(prompt_ids, n)
        base_seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        group = len(prompts) if self.max_batch_size is None else max(1, self.max_batch_size // n)
        rows: list[tuple[list[int], list[float], str]] = []
        humming_fp4.refresh_stale()  # captured graphs read humming's repacked copies, not the packed weights
        with inference_mode(self.model), self._lora_in_compute_dtype(), \
                projections_fused(self._groups, compute_dtype(self.model)), \
                cpu_dense_copies(self.model, self._groups, compute_dtype(self.model)) as dense:
            self.stats["dense_copies"] = int(dense)
            for start in range(0, len(prompts), group):
                chunk = prompts[start:start + group]
                rows += self._generate_group(chunk, n, sampling, base_seed, first_row=sampling.first_row + start * n)
        return RolloutOutput(
            prompt_ids=[p for p in prompts for _ in range(n)],
            completion_ids=[r[0] for r in rows], logprobs=[r[1] for r in rows],
            finish_reasons=[r[2] for r in rows], stats=dict(self.stats))

    def warm_up(self, prompt_ids, n: int = 1, sampling: SamplingParams | None = None) -> dict:
        """Get a call like generate(prompt_ids, n, sampling) ready without running it to the end: the prefill and
        the first decode steps only (compilation, the eager warm-up steps, the CUDA-graph capture and one replay).
        A later generate with the same rows, cache-length bucket, max_tokens and sampling knobs then replays the
        captured step from its first decode step. Returns what it did, as the change of `stats`."""
        before = dict(self.stats)
        self._stop_after = WARMUP_STEPS + 2  # eager warm-up steps, the capture, one replay
        try:
            self.generate(prompt_ids, n=n, sampling=sampling)
        finally:
            self._stop_after = None
        return {k: v - before.get(k, 0) for k, v in self.stats.items() if isinstance(v, (int, float))}

    def fuse_projections(self, kinds=("fp4", "dense")) -> int:
        """Group the projections of these layer kinds (after ungrouping any); returns the number of groups."""
        self.unfuse_projections()
        self._groups = group_projections(self.model, kinds=tuple(kinds), plain=self.plain_projections)
        self.stats["projection_groups"] = len(self._groups)
        return len(self._groups)

    def unfuse_projections(self) -> None:
        """Give the grouped layers their own weights back; later calls run them one by one."""
        ungroup_projections(self._groups)
        self._groups = []
        self._forward, self._decoder = None, None  # traced / captured with the previous layer forwards
        self.stats["projection_groups"] = 0

    def close(self) -> None:
        self.unfuse_projections()
        self._forward, self._decoder, self._shadows = None, None, {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _lora_in_compute_dtype(self):
        return lora_in_dtype(self.model, self.lora_dtype, self._shadows)

    # ---------------------------------------------------------------- one group of prompts
    def _generate_group(self, prompts, n, sampling: SamplingParams, base_seed: int, first_row: int):
        """Prefill the group once, repeat each prompt's cache n times, decode all rows together."""
        num_rows, max_new = len(prompts) * n, sampling.max_tokens
        if self.cache_kind == "static":
            self._check_static_fits(prompts, n, max_new)
        ids, mask, pos = _left_pad(prompts, self.pad_id, self.device)
        uniforms = None if sampling.greedy else row_uniforms(base_seed, first_row, num_rows, max_new, self.device)
        dynamic = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=dynamic,
                         use_cache=True, logits_to_keep=1)
        self.stats["prefill_calls"] += 1
        self.stats["prefill_rows"] += ids.shape[0]
        logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)
        mask, pos = mask.repeat_interleave(n, dim=0), pos[:, -1:].repeat_interleave(n, dim=0)
        stop_check = StopChecker(self.tokenizer, sampling.stop, self.eos_ids, self.device)
        if self.cache_kind == "static":
            return self._decode_static(dynamic, n, logits, mask, pos, uniforms, sampling, stop_check)
        dynamic.batch_repeat_interleave(n)
        return self._decode_dynamic(dynamic, logits, mask, pos, uniforms, sampling, stop_check)

    def _decode_dynamic(self, cache, logits, mask, pos, uniforms, sampling, stop_check):
        """Rows that finish leave the batch (their cache rows are dropped): less work as sequences end."""
        num_rows, prompt_len, max_new = mask.shape[0], mask.shape[1], sampling.max_tokens
        full_mask = torch.zeros(num_rows, prompt_len + max_new, dtype=mask.dtype, device=self.device)
        full_mask[:, :prompt_len] = mask
        tokens = torch.full((num_rows, max_new), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(num_rows, max_new, dtype=torch.float32, device=self.device)
        lengths = torch.full((num_rows,), max_new, dtype=torch.long, device=self.device)
        stopped = torch.zeros(num_rows, dtype=torch.bool, device=self.device)
        rows = torch.arange(num_rows, device=self.device)
        last = self._last_step(max_new)
        for step in range(max_new):
            u = None if uniforms is None else uniforms[rows, step]
            tok, lp = sample_tokens(logits, sampling, u)
            tokens[rows, step], logprobs[rows, step] = tok, lp
            done = stop_check(tok, tokens, rows, step)
            lengths[rows] = torch.where(done, step + 1, lengths[rows])
            stopped[rows] = done
            if step == last:
                break
            if bool(done.any()):
                keep = (~done).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                cache.batch_select_indices(keep)
                rows, full_mask, pos, tok = rows[keep], full_mask[keep], pos[keep], tok[keep]
            full_mask[:, prompt_len + step] = 1
            pos = pos + 1
            logits = _decode_forward(self.model, tok[:, None], full_mask[:, :prompt_len + step + 1], pos, cache)
            self.stats["decode_calls"] += 1
        return _to_rows(tokens, logprobs, lengths, stopped)

    def _decode_static(self, dynamic, n, logits, mask, pos, uniforms, sampling, stop_check):
        """Fixed shapes: the whole step runs from the decoder's buffers (a CUDA-graph replay once captured)."""
        num_rows, prompt_len, max_new = mask.shape[0], mask.shape[1], sampling.max_tokens
        cache_len = self._cache_len(prompt_len, max_new)
        key = (num_rows, cache_len, sampling_key(sampling), model_signature(self.model))
        if self._decoder is None or self._decoder.key != key:
            self._decoder = None  # free the previous cache and graph first
            self._decoder = StaticDecoder(self, key, num_rows, cache_len, sampling)
        dec = self._decoder
        dec.start(dynamic, n, logits, mask, pos, uniforms, max_new)
        every = 1 if sampling.stop else _SYNC_EVERY
        last = self._last_step(max_new)
        for step in range(1, last + 1):  # step = index of the token sampled by this iteration
            if sampling.stop:
                dec.apply_stops(stop_check, step - 1)
            if step % every == 0 and bool(dec.done.all()):
                break
            dec.advance()
            self.stats["decode_calls"] += 1
        else:
            if sampling.stop:
                dec.apply_stops(stop_check, last)
        return _to_rows(dec.tokens[:, :max_new], dec.logprobs[:, :max_new], dec.lengths, dec.done)

    def _cache_len(self, prompt_len: int, max_new: int) -> int:
        if self.use_cuda_graph:  # bucketed: graphs are reused across calls with other prompt widths
            return -(-(prompt_len + max_new) // _STATIC_BUCKET) * _STATIC_BUCKET
        return prompt_len + max_new

    def _check_static_fits(self, prompts, n: int, max_new: int) -> None:
        """Refuse a group whose static cache cannot fit the free memory, before its prefill allocates anything (a
        raw CUDA OOM mid-call otherwise); the last call's decoder, freed for it, counts as free."""
        free = free_memory_bytes(self.device)
        if free is None:
            return
        width = max(len(p) for p in prompts)
        rows, positions = len(prompts) * n, self._cache_len(width, max_new)
        if self._decoder is not None:
            held_rows, held_len = self._decoder.key[:2]
            if (held_rows, held_len) == (rows, positions):
                return  # its buffers are already allocated and reused
            free += static_cache_bytes(self.model, held_rows, held_len)
        check_static_fits(self.model, rows, positions, free, prompts=len(prompts), prompt_len=width)

    def _last_step(self, max_new: int) -> int:
        """Index of the last token a call samples: max_new - 1, or earlier in a warm_up call."""
        return max_new - 1 if self._stop_after is None else min(max_new - 1, self._stop_after)

    def decode_forward_fn(self):
        """The decode step's forward (compiled when use_compile); StaticDecoder calls it."""
        if self._forward is None:
            self._forward = (torch.compile(_decode_forward, dynamic=True, options=compile_options(self.device))
                             if self.use_compile else _decode_forward)
        return self._forward

    def fall_back(self, what: str, exc: Exception):
        """A failed torch.compile or CUDA-graph capture (StaticDecoder reports it): warn, and go on without it."""
        warnings.warn(f"TorchEngine: {what} failed ({type(exc).__name__}: {exc}); decoding without it from now on",
                      RuntimeWarning, stacklevel=3)
        if what == "torch.compile":
            self.use_compile, self._forward = False, None
        else:
            self.use_cuda_graph = False


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


def _to_rows(tokens, logprobs, lengths, stopped):
    """One host transfer at the end; rows trimmed to their own length."""
    tokens, logprobs, lengths, stopped = tokens.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist()
    return [(t[:k], lp[:k], "stop" if s else "length") for t, lp, k, s in zip(tokens, logprobs, lengths, stopped)]
