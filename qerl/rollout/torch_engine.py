"""Rollouts on the very modules being trained (FP4 base + LoRA + in-place AQN noise): no copy, no sync.

    engine = TorchEngine(model, tokenizer)
    out = engine.generate(prompt_ids, n=8, sampling=SamplingParams(temperature=1.0, max_tokens=256, seed=0))

One call = one batch of len(prompts) * n rows. Each prompt is prefilled once (left-padded batch) and its
KV cache is repeated n times, then all rows decode together. On CPU the cache is a DynamicCache and rows
that finished are dropped from the batch (less work as sequences end). On CUDA a StaticCache keeps shapes
fixed and one whole decode step - feed the last token, forward (torch.compile'd, so pointwise ops fuse), sample,
record token / log-prob / EOS - runs on the GPU from preallocated buffers, captured once as a CUDA graph and
replayed: the host launches one graph per token and reads back one flag every _SYNC_EVERY steps.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
from transformers import DynamicCache, StaticCache

from qerl.errors import QerlError
from qerl.quant.grouped import group_projections, projections_fused, ungroup_projections
from qerl.rollout.attention import attention_implementation
from qerl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams, check_prompts
from qerl.rollout.lora_shadows import lora_in_dtype
from qerl.rollout.sampling import StopChecker, row_uniforms, sample_tokens

_STATIC_BUCKET = 128  # static KV length is rounded up to this, bounding CUDA-graph recaptures
_SYNC_EVERY = 16  # static decode checks "all rows finished" on the host every this many steps (no stop strings)
_WARMUP_STEPS = 2  # eager steps (compilation, lazy allocations) before a decode step is captured


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
    "(b) Rollout", engine choices.
    """

    def __init__(self, model, tokenizer, *, max_batch_size: int | None = None, use_cuda_graph="auto",
                 cache: str = "auto", eos_token_ids=None, compile="auto", lora_dtype="auto",
                 fuse_projections="auto"):
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
        on_cuda = self.device.type == "cuda"
        self.cache_kind = cache if cache != "auto" else ("static" if on_cuda else "dynamic")
        self.use_cuda_graph = on_cuda and self.cache_kind == "static" and use_cuda_graph in (True, "auto")
        if use_cuda_graph is True and not self.use_cuda_graph:
            raise QerlError("TorchEngine.use_cuda_graph=True needs the model on CUDA and cache='static'|'auto'")
        self.use_compile = compile is True or (compile == "auto" and self.use_cuda_graph)
        self.eos_ids = sorted(_eos_ids(model, tokenizer) if eos_token_ids is None else set(eos_token_ids))
        self.pad_id = _pad_id(model, tokenizer, self.eos_ids)
        self.stats = {"prefill_calls": 0, "prefill_rows": 0, "decode_calls": 0, "graph_captures": 0,
                      "graph_replays": 0}
        self._forward = None  # the (compiled) decode forward, built on first use
        self._decoder = None  # the _StaticDecoder of the last call, reused while its key matches
        self._stop_after = None  # decode steps a warm_up call runs (None: to max_tokens)
        if lora_dtype not in (None, "auto") and not isinstance(lora_dtype, torch.dtype):
            raise QerlError(f"TorchEngine.lora_dtype: expected None, 'auto' or a torch.dtype, got {lora_dtype!r}")
        self.lora_dtype = (_compute_dtype(model) if on_cuda else None) if lora_dtype == "auto" else lora_dtype
        self._shadows: dict[int, torch.nn.Parameter] = {}  # id(adapter weight) -> its copy in lora_dtype
        if fuse_projections not in (True, False, "auto"):
            raise QerlError(f"TorchEngine.fuse_projections: expected True, False or 'auto', got {fuse_projections!r}")
        self._groups: list = []
        self.stats["projection_groups"] = 0
        if fuse_projections is True or (fuse_projections == "auto" and on_cuda):
            self.fuse_projections(("fp4", "dense"))

    # ---------------------------------------------------------------- public API
    def generate(self, prompt_ids, n: int = 1, sampling: SamplingParams | None = None) -> RolloutOutput:
        sampling = sampling or SamplingParams()
        prompts = check_prompts(prompt_ids, n)
        base_seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        group = len(prompts) if self.max_batch_size is None else max(1, self.max_batch_size // n)
        rows: list[tuple[list[int], list[float], str]] = []
        with _inference_mode(self.model), self._lora_in_compute_dtype(), \
                projections_fused(self._groups, _compute_dtype(self.model)):
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
        self._stop_after = _WARMUP_STEPS + 2  # eager warm-up steps, the capture, one replay
        try:
            self.generate(prompt_ids, n=n, sampling=sampling)
        finally:
            self._stop_after = None
        return {k: v - before.get(k, 0) for k, v in self.stats.items() if isinstance(v, (int, float))}

    def fuse_projections(self, kinds=("fp4", "dense")) -> int:
        """Group the projections of these layer kinds (after ungrouping any); returns the number of groups."""
        self.unfuse_projections()
        self._groups = group_projections(self.model, kinds=tuple(kinds))
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
        ids, mask, pos = _left_pad(prompts, self.pad_id, self.device)
        num_rows, max_new = len(prompts) * n, sampling.max_tokens
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
        cache_len = prompt_len + max_new
        if self.use_cuda_graph:  # bucketed: graphs are reused across calls with other prompt widths
            cache_len = -(-cache_len // _STATIC_BUCKET) * _STATIC_BUCKET
        key = (num_rows, cache_len, _sampling_key(sampling), _model_signature(self.model))
        if self._decoder is None or self._decoder.key != key:
            self._decoder = None  # free the previous cache and graph first
            self._decoder = _StaticDecoder(self, key, num_rows, cache_len, sampling)
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

    def _last_step(self, max_new: int) -> int:
        """Index of the last token a call samples: max_new - 1, or earlier in a warm_up call."""
        return max_new - 1 if self._stop_after is None else min(max_new - 1, self._stop_after)

    def _decode_forward_fn(self):
        if self._forward is None:
            self._forward = (torch.compile(_decode_forward, dynamic=True, options=_compile_options(self.device))
                             if self.use_compile else _decode_forward)
        return self._forward

    def _fall_back(self, what: str, exc: Exception):
        warnings.warn(f"TorchEngine: {what} failed ({type(exc).__name__}: {exc}); decoding without it from now on",
                      RuntimeWarning, stacklevel=3)
        if what == "torch.compile":
            self.use_compile, self._forward = False, None
        else:
            self.use_cuda_graph = False


class _StaticDecoder:
    """Preallocated state of one static-shape decode: KV cache, mask, positions, sampled tokens, EOS flags.

    `advance()` feeds the last sampled token, runs the forward, samples the next token with its uniform and
    records token / log-prob / length / done, without any host synchronisation. On CUDA the step is warmed up
    eagerly (_WARMUP_STEPS real steps), then captured as a CUDA graph and replayed for every later step and call
    with the same key (rows, cache length, sampling knobs, model state): a call only refills the buffers.
    """

    def __init__(self, engine: TorchEngine, key, rows: int, cache_len: int, sampling: SamplingParams):
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
        _static_from_dynamic(self.cache, dynamic, n)
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
        forward = self.engine._decode_forward_fn()
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
        if not engine.use_cuda_graph or self.eager_steps < _WARMUP_STEPS:
            self._eager_step()
            return
        counters = [layer.cumulative_length.clone() for layer in self.cache.layers]
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # its own memory pool, released with the decoder
                self._body()
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager steps
            engine._fall_back("CUDA-graph capture", exc)
            for layer, count in zip(self.cache.layers, counters):  # nothing ran, but be safe
                layer.cumulative_length.copy_(count)
            self._eager_step()
            return
        self.graph = graph
        engine.stats["graph_captures"] += 1
        graph.replay()  # capturing records the step without running it
        engine.stats["graph_replays"] += 1

    def _eager_step(self):
        """One step eagerly (on CUDA on a side stream, as graph warm-up wants); a compile failure falls back."""
        self.eager_steps += 1
        side = torch.cuda.Stream() if self.engine.device.type == "cuda" else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
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
            self.engine._fall_back("torch.compile", exc)
            for layer, count in zip(self.cache.layers, counters):
                layer.cumulative_length.copy_(count)
            for t, saved in zip((self.mask, self.pos, self.col), state):
                t.copy_(saved)
            self._body()


def _decode_forward(model, tok, mask, pos, cache):
    out = model(input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    return out.logits[:, -1].float()


def _compile_options(device: torch.device) -> dict:
    """Inductor options of the decode forward: its Triton kernels with programmatic dependent launch on Hopper+
    (each starts while the previous kernel finishes and waits for it before reading its output; QERL_PDL=0 turns
    it off, as for qerl.quant's FP4 kernels) where this torch's inductor has the option."""
    from torch._inductor import config as inductor_config

    from qerl.quant.dispatch import pdl_mode

    if (device.type == "cuda" and pdl_mode() != "0" and hasattr(inductor_config.triton, "enable_pdl")
            and torch.cuda.get_device_capability(device)[0] >= 9):
        return {"triton.enable_pdl": True}
    return {}


def _compute_dtype(model) -> torch.dtype:
    """The dtype the model computes in: its input embeddings' (FP4 layers hold uint8, adapters may be fp32)."""
    try:
        return model.get_input_embeddings().weight.dtype
    except (AttributeError, NotImplementedError):
        return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _sampling_key(sampling: SamplingParams) -> tuple:
    """The sampling knobs a captured step bakes in (seeds and max_tokens live in buffers)."""
    return (sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p)


def _model_signature(model) -> tuple:
    """What a captured step depends on beyond tensor contents: parameter storage and peft adapter switches."""
    ptrs = tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
    switches = tuple((bool(getattr(m, "disable_adapters", False)), bool(getattr(m, "merged", False)),
                      tuple(getattr(m, "active_adapters", ())))
                     for m in model.modules() if hasattr(m, "active_adapters") and hasattr(m, "lora_A"))
    return hash(ptrs), hash(switches), model.training


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


_INPUT_GRAD_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")  # transformers', peft's


@contextlib.contextmanager
def _inference_mode(model):
    """eval() for the call (no dropout, no gradient checkpointing), each module's own mode restored after; the
    input-embedding hooks that gradient checkpointing with adapters installs (transformers'
    `enable_input_require_grads`, peft's fallback: `output.requires_grad_(True)`) are lifted meanwhile: useless
    without autograd, and torch.compile (2.11, the GPU image's) cannot trace them: the graph break, inside a
    transformers context manager, left the model forward uncompiled and each layer compiled on its own, past
    dynamo's recompile limit (8) the later layers not at all (BENCHMARKS.md, "(b) Rollout", engine choices)."""
    modes = [(m, m.training) for m in model.modules()]
    lifted = []
    for m in model.modules():
        hooks = [(k, h) for k, h in m._forward_hooks.items() if getattr(h, "__name__", "") in _INPUT_GRAD_HOOKS]
        for k, _ in hooks:
            del m._forward_hooks[k]
        if hooks:
            lifted.append((m, hooks))
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        for m, training in modes:
            m.training = training
        for m, hooks in lifted:  # back in registration order (handle ids increase)
            merged = sorted([*m._forward_hooks.items(), *hooks], key=lambda item: item[0])
            m._forward_hooks.clear()
            m._forward_hooks.update(merged)
