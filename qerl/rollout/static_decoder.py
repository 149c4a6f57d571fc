"""The static-shape decode of TorchEngine: its memory estimate and one-line refusal, and the preallocated state one
decode step runs from (captured once as a CUDA graph on CUDA and replayed).

    check_static_fits(model, rows=1024, positions=4608, free=free_memory_bytes(device))  # QerlError if it cannot fit
    dec = StaticDecoder(engine, key, rows, cache_len, sampling); dec.start(...); dec.advance()

The engine (qerl.rollout.torch_engine) owns the call: prefill, the loop over steps, stop strings, the results; the
decoder calls back its `decode_forward_fn()` (the possibly compiled forward) and `fall_back()` (a failed compile or
capture turns that feature off for later calls).
"""
from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache, StaticCache

from qerl.errors import QerlError
from qerl.quant.kernels.device import decode_step_launches
from qerl.rollout.attention import attention_implementation
from qerl.rollout.kv_pool import bytes_per_token, kv_shape
from qerl.rollout.sampling import StopChecker, sample_tokens

WARMUP_STEPS = 2  # eager steps (compilation, lazy allocations) before a decode step is captured


def free_memory_bytes(device: torch.device) -> int | None:
    """What a new allocation can get on a CUDA device: free memory plus what torch's caching allocator holds unused;
    None elsewhere (no limit is checked)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def static_cache_bytes(model, rows: int, positions: int, *, prompts: int = 0, prompt_len: int = 0) -> int:
    """Bytes one static-cache group allocates: K/V for rows x positions and the decoder's per-position buffers
    (token 8, log-prob 4, uniform 4, mask 1 bytes), the prompts' prefill cache with one layer of it repeated for the
    rows, and float32 logits plus sampling temporaries (4 copies) per row."""
    per_token = bytes_per_token(model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return (rows * positions * (per_token + 17) + prompts * prompt_len * per_token
            + rows * prompt_len * per_token // kv_shape(model)[0] + rows * config.vocab_size * 4 * 4)


def check_static_fits(model, rows: int, positions: int, free: int, *, prompts: int = 0, prompt_len: int = 0) -> None:
    """One QerlError line when a static-cache group of rows x positions needs more than `free` bytes."""
    need = static_cache_bytes(model, rows, positions, prompts=prompts, prompt_len=prompt_len)
    if need > free:
        raise QerlError(
            f"rollout: {rows:,} rows x {positions:,} positions (the longest prompt + max_tokens, at most "
            f"max_prompt_length + max_completion_length) need ~{need / 2**30:.1f} GiB of static KV cache and decode "
            f"buffers but {free / 2**30:.1f} GiB of GPU memory is free; set `rollout.engine: paged` (KV blocks for "
            f"the tokens actually live, within rollout.gpu_memory_utilization of free memory), or lower the rows "
            f"(batch_size x num_generations, or max_batch_size) or max_prompt_length + max_completion_length")


def static_from_dynamic(static: StaticCache, dynamic: DynamicCache, n: int) -> StaticCache:
    """Copy the prefilled prompts (repeated n times) into a preallocated cache for static-shape decoding."""
    for src, dst in zip(dynamic.layers, static.layers):
        keys, values = src.keys.repeat_interleave(n, dim=0), src.values.repeat_interleave(n, dim=0)
        if dst.is_initialized:
            dst.reset()
        else:
            dst.lazy_initialization(keys, values)
        dst.update(keys, values)
    return static


class StaticDecoder:
    """Preallocated state of one static-shape decode: KV cache, mask, positions, sampled tokens, EOS flags.

    `advance()` feeds the last sampled token, runs the forward, samples the next token with its uniform and
    records token / log-prob / length / done, without any host synchronisation. On CUDA the step is warmed up
    eagerly (WARMUP_STEPS real steps), then captured as a CUDA graph and replayed for every later step and call
    with the same key (rows, cache length, sampling knobs, model state): a call only refills the buffers.
    """

    def __init__(self, engine, key, rows: int, cache_len: int, sampling: SamplingParams):
        dev, model = engine.device, engine.model
        self.engine, self.key, self.sampling = engine, key, sampling
        self.cache = StaticCache(config=model.config, max_cache_len=cache_len)
        self.eos = torch.tensor(engine.eos_ids, dtype=torch.long, device=dev)
        self.tok = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.mask = torch.zeros(rows, cache_len, dtype=torch.bool, device=dev)
        self.col = torch.zeros(1, dtype=torch.long, device=dev)  # cache slot of the token fed next
        self.step = torch.zeros(1, dtype=torch.long, device=dev)  # completion index of the token sampled next
        self.tokens = torch.full((rows, cache_len), engine.pad_id, dtype=torch.long, device=dev)
        self.logprobs = torch.zeros(rows, cache_len, dtype=torch.float32, device=dev)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)
        self.done = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.uniforms = torch.zeros(rows, cache_len, dtype=torch.float32, device=dev)
        self.graph, self.eager_steps = None, 0

    def start(self, dynamic, n, logits, mask, pos, uniforms, max_new: int):
        """Load a prefilled group (prompt cache repeated n times) and sample its first token."""
        prompt_len = mask.shape[1]
        static_from_dynamic(self.cache, dynamic, n)
        self.mask.zero_()
        self.mask[:, :prompt_len] = mask.bool()
        self.pos.copy_(pos)
        self.col.fill_(prompt_len)
        self.step.zero_()
        self.tokens.fill_(self.engine.pad_id)
        self.logprobs.zero_()
        self.lengths.fill_(max_new)
        self.done.zero_()
        if uniforms is not None:
            self.uniforms[:, :max_new] = uniforms
        self._record(logits)

    def _record(self, logits):
        idx = self.step
        u = None if self.sampling.greedy else self.uniforms.index_select(1, idx).squeeze(1)
        tok, lp = sample_tokens(logits, self.sampling, u)
        tok = tok.masked_fill(self.done, self.engine.pad_id)
        self.tokens.index_copy_(1, idx, tok[:, None])
        self.logprobs.index_copy_(1, idx, lp[:, None])
        self._mark_done(torch.isin(tok, self.eos), idx + 1)
        self.tok.copy_(tok[:, None])
        self.step.add_(1)

    def _body(self):
        self.mask.index_fill_(1, self.col, True)
        self.pos.add_(1)
        forward = self.engine.decode_forward_fn()
        with attention_implementation(self.engine.model):  # grouped-query decode attention, bool mask
            logits = forward(self.engine.model, self.tok, self.mask[:, None, None, :], self.pos, self.cache)
        self._record(logits)
        self.col.add_(1)

    def apply_stops(self, stop_check: StopChecker, step: int):
        """Host-side stop-string check of token `step` (one sync); rows that stop are marked done."""
        rows = torch.arange(self.tokens.shape[0], device=self.tokens.device)
        self._mark_done(stop_check(self.tokens[:, step], self.tokens, rows, step), step + 1)

    def _mark_done(self, hit, length):
        """Rows in `hit` that were still running end with `length` tokens."""
        hit = hit & ~self.done
        self.lengths.copy_(torch.where(hit, length, self.lengths))
        self.done.logical_or_(hit)

    def advance(self):
        engine = self.engine
        if self.graph is not None:
            self.graph.replay()
            engine.stats["graph_replays"] += 1
            return
        if not engine.use_cuda_graph or self.eager_steps < WARMUP_STEPS:
            self._eager_step(warm_up=engine.use_cuda_graph)
            return
        counters = [layer.cumulative_length.clone() for layer in self.cache.layers]
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # its own memory pool, released with the decoder
                self._body()
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager steps
            engine.fall_back("CUDA-graph capture", exc)
            for layer, count in zip(self.cache.layers, counters):  # nothing ran, but be safe
                layer.cumulative_length.copy_(count)
            self._eager_step()
            return
        self.graph = graph
        engine.stats["graph_captures"] += 1
        graph.replay()  # capturing records the step without running it
        engine.stats["graph_replays"] += 1

    def _eager_step(self, warm_up: bool = False):
        """One step eagerly (on CUDA on a side stream, as graph warm-up wants); a compile failure falls back.
        warm_up: the step is captured next, so its kernels launch as the capture's (decode_step_launches)."""
        self.eager_steps += 1
        side = torch.cuda.Stream() if self.engine.device.type == "cuda" else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext(), \
                decode_step_launches() if warm_up and side is not None else contextlib.nullcontext():
            if self.engine.use_compile:
                self._compiled_eager_step()
            else:
                self._body()
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)

    def _compiled_eager_step(self):
        """A step through the compiled forward; if compiling fails, the step is undone and run uncompiled (the
        snapshot is taken only here: uncompiled eager steps, every step on CPU, need none)."""
        counters = [layer.cumulative_length.clone() for layer in self.cache.layers]
        state = [t.clone() for t in (self.mask, self.pos, self.col)]
        try:
            self._body()
        except Exception as exc:  # noqa: BLE001
            self.engine.fall_back("torch.compile", exc)
            for layer, count in zip(self.cache.layers, counters):
                layer.cumulative_length.copy_(count)
            for t, saved in zip((self.mask, self.pos, self.col), state):
                t.copy_(saved)
            self._body()
