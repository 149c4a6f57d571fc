"""Continuous batching over a paged KV cache, on the very modules being trained (peft LoRA, FP4 layers, AQN noise).

    engine = PagedEngine(model, tokenizer, block_size=16, num_blocks=None)   # None: sized from free GPU memory
    out = engine.generate(prompt_ids, n=8, sampling=SamplingParams(temperature=1.0, max_tokens=4096, seed=0))

Unlike TorchEngine, memory grows with the tokens actually live, not rows x full length: a row that ends frees its
blocks at once and waiting rows take its place; when the pool runs out, the newest running row is preempted and
recomputed later (qerl.rollout.scheduler). Each step is one packed forward ([1, tokens of all scheduled rows]) whose
attention layers write and read the pool (qerl.rollout.paged_attention). A step of decode rows only runs padded to
a batch-size bucket from static buffers, as a CUDA graph on CUDA (qerl.rollout.paged_graphs); steps with prefill
chunks or forks run eagerly. A row's token t is drawn with uniform
(seed, row, t), exactly as TorchEngine draws it, so rows do not depend on the schedule, the batch or preemption
beyond floating-point rounding. Log-probs are log_softmax(logits / T) over the full vocabulary (raw logits if greedy).
"""
from __future__ import annotations

import functools
import logging
import time

import torch

from qerl import compile_cache
from qerl.compile_cache import CompileClock
from qerl.errors import QerlError
from qerl.quant import dense_copies as dc
from qerl.quant.dispatch import HUMMING_MIN_ROWS, fp4_humming_mode
from qerl.quant.grouped import group_projections, projections_fused, ungroup_projections
from qerl.quant.humming_copies import attach_humming_copies, detach_humming_copies, humming_copy_bytes
from qerl.quant.kernels import humming_fp4
from qerl.quant.linear import DENSE_COPY_MIN_ROWS
from qerl.rollout.attention import attention_implementation, sdpa_without_cudnn
from qerl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams, check_prompts
from qerl.rollout.kv_pool import (BlockAllocator, KVPool, bytes_per_token, expandable_segments, free_device_memory,
                                  kv_shape)
from qerl.rollout.lora_shadows import lora_in_dtype
from qerl.rollout.model_state import compile_options, compute_dtype, eos_ids, inference_mode, model_signature
from qerl.rollout.paged_attention import NAME, PagedMeta, triton_paged
from qerl.rollout.layer_compile import LayerCompile
from qerl.rollout.decode_pipeline import pipelined_decode, step_inputs
from qerl.rollout.paged_graphs import DecodeGraphs, compiled_decode_forward
from qerl.rollout.residency import resident_blocks
from qerl.rollout.sampling import row_uniforms, sample_tokens, sampling_key
from qerl.rollout.scheduler import Scheduler, blocks_for, check_fits

log = logging.getLogger("qerl.rollout.paged")
_MAX_BUCKET = 512  # largest decode bucket when max_num_seqs is None; more running rows decode unpadded

_DENSE_COPY_FREE_FRACTION = 0.25  # "auto" keeps dense copies only if they leave >= 75% of free memory to the pool
_RESERVE_SLACK = 512 * 2**20  # allocator fragmentation and library workspaces, on top of the estimated activations


class PagedEngine(RolloutEngine):
    """Paged-KV continuous batching with the model object given (HF causal LM, peft-wrapped or not).

    block_size: tokens per KV block. num_blocks: pool size including the reserved null block; None = on CUDA from
    free memory x gpu_memory_utilization (minus a forward's activations), on CPU just enough for every row at full
    length. max_num_batched_tokens: tokens one step computes (decode rows + prefill chunks). max_num_seqs: running
    rows cap (None = no cap). eos_token_ids overrides the EOS set read from generation_config and tokenizer.
    decode_buckets: decode-only steps run padded to a batch-size bucket from static buffers (True), captured as
    CUDA graphs on CUDA where the Triton decode kernel runs; False: every step packed and eager; "auto": on CUDA.
    compile: torch.compile the bucketed decode forward (True, False, or "auto" = where it is captured as CUDA
    graphs), as TorchEngine's; a compile failure warns and decodes uncompiled.
    lora_dtype, fuse_projections, plain_projections: as TorchEngine's, with its defaults ("auto": the model's compute
    dtype, and FP4 + dense projection groups, on CUDA only), in place around each call; graphs are captured with
    them in place.
    dense_weights: keep a dequantized copy of the FP4 base weights for the rollout (qerl.quant.dense_copies;
    steps of >= DENSE_COPY_MIN_ROWS rows run cuBLAS on it, fewer rows the FP4 kernels), made with the pool and
    given back with it by sleep(): True, False, or "auto" = on CUDA when the call has that many rows and the
    copies take at most a quarter of the free memory (7B on an 80 GB GPU: yes; 32B: no).
    pipeline_decode: runs of bucketed decode steps keep one step in flight, the host planning the next while the
    device runs one (qerl.rollout.decode_pipeline; same rows): True, False, or "auto" = on CUDA.
    resident: "auto" = once plan_update() gave the update's need, the next pool leaves that free (holding every row at
    full length, or what the last call used and more) and stays with graphs and copies across sleep()
    (qerl.rollout.residency); False: never.
    """

    def __init__(self, model, tokenizer, *, block_size: int = 16, num_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.85, max_num_batched_tokens: int = 8192,
                 max_num_seqs: int | None = None, eos_token_ids=None, decode_buckets="auto",
                 compile="auto", lora_dtype="auto", fuse_projections="auto", dense_weights="auto",
                 pipeline_decode="auto", resident="auto", plain_projections=True):
        for name, value in (("block_size", block_size), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise QerlError(f"PagedEngine.{name}: expected an int >= 1, got {value!r}")
        if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 2):
            raise QerlError(f"PagedEngine.num_blocks: expected None or an int >= 2, got {num_blocks!r}")
        if max_num_seqs is not None and (not isinstance(max_num_seqs, int) or max_num_seqs < 1):
            raise QerlError(f"PagedEngine.max_num_seqs: expected None or an int >= 1, got {max_num_seqs!r}")
        for name, value in (("decode_buckets", decode_buckets), ("compile", compile),
                            ("fuse_projections", fuse_projections), ("dense_weights", dense_weights),
                            ("pipeline_decode", pipeline_decode)):
            if value not in (True, False, "auto"):
                raise QerlError(f"PagedEngine.{name}: expected True, False or 'auto', got {value!r}")
        if lora_dtype not in (None, "auto") and not isinstance(lora_dtype, torch.dtype):
            raise QerlError(f"PagedEngine.lora_dtype: expected None, 'auto' or a torch.dtype, got {lora_dtype!r}")
        if resident not in (False, "auto"):
            raise QerlError(f"PagedEngine.resident: expected False or 'auto', got {resident!r}")
        self.resident, self.update_bytes, self._resident_pool = resident, None, False
        self.dense_weights, self.dense_bytes = dense_weights, 0
        self.humming_bytes, self.humming_check = 0, {}
        self.dense_check: dict = {}  # the last "auto" decision: bytes needed and free, kept or not
        self._pool_rows = 0  # rows of the call the GPU pool's forward reserve was sized for
        self.model, self.tokenizer = model, tokenizer
        self.block_size, self.num_blocks = block_size, num_blocks
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.device = next(model.parameters()).device
        expandable_segments(self.device)  # before the pool, the dense copies and the update allocate anything
        self.eos_ids = set(eos_ids(model, tokenizer) if eos_token_ids is None else eos_token_ids)
        self.decode_buckets = decode_buckets is True or (decode_buckets == "auto" and self.device.type == "cuda")
        self.pipeline_decode = pipeline_decode is True or (pipeline_decode == "auto" and self.device.type == "cuda")
        self._graphs: DecodeGraphs | None = None  # kept across calls while its key matches
        self.compile = compile
        self._compiled = None  # the compiled decode forward, built on first use
        self.pool: KVPool | None = None
        self.allocator: BlockAllocator | None = None  # the last call's, for inspection
        self.stats: dict = {}
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            compile_cache.install_triton_clock()  # the first call's log names our Triton kernels' JIT seconds too
        self.lora_dtype = (compute_dtype(model) if on_cuda else None) if lora_dtype == "auto" else lora_dtype
        self._shadows: dict[int, torch.nn.Parameter] = {}  # id(adapter weight) -> its copy in lora_dtype
        self._groups: list = []
        if plain_projections not in (True, False):
            raise QerlError(f"PagedEngine.plain_projections: expected True or False, got {plain_projections!r}")
        self.plain_projections = plain_projections
        if fuse_projections is True or (fuse_projections == "auto" and on_cuda):
            self.fuse_projections(("fp4", "dense"))

    # ---------------------------------------------------------------- public API
    def generate(self, prompt_ids, n: int = 1, sampling: SamplingParams | None = None) -> RolloutOutput:
        sampling = sampling or SamplingParams()
        prompts = check_prompts(prompt_ids, n)
        clock = CompileClock()
        if self.num_blocks is not None:  # known size: refuse before allocating anything
            check_fits(prompts, sampling.max_tokens, self.block_size, self.num_blocks)
        if self.pool is not None and self._pool_rows and len(prompts) * n > self._pool_rows:
            self._release_pool()  # its forward reserve was sized for fewer sampling rows
        kept = self.pool is not None
        if kept:  # the copies too: nothing was built for this call
            self.humming_check.pop("build_s", None)
        if self.pool is None:  # the copies first, so that the pool is sized from what they leave
            self._keep_humming_copies(len(prompts) * n)
            self._keep_dense_copies(len(prompts) * n)
        pool = self._pool_for(prompts, n, sampling.max_tokens)
        check_fits(prompts, sampling.max_tokens, self.block_size, pool.num_blocks)
        base_seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        host_uniforms = None if sampling.greedy else row_uniforms(base_seed, sampling.first_row, len(prompts) * n,
                                                                  sampling.max_tokens, "cpu")
        uniforms = None if host_uniforms is None else (host_uniforms.to(self.device), host_uniforms.numpy())
        self.allocator = BlockAllocator(pool.num_blocks)
        sched = Scheduler(prompts, n, sampling.max_tokens, self.allocator, self.block_size,
                          self.max_num_batched_tokens, self.max_num_seqs)
        with inference_mode(self.model), lora_in_dtype(self.model, self.lora_dtype, self._shadows), \
                projections_fused(self._groups, compute_dtype(self.model)), \
                attention_implementation(self.model, NAME), sdpa_without_cudnn():  # prefills bring new lengths
            dc.refresh_stale_copies(self.model)  # captured graphs read the weight copies, not the packed weights
            graphs = self._graphs_for(prompts, sampling, pool)
            before = dict(graphs.stats) if graphs is not None else {}
            seconds = dict.fromkeys(_STEP_BINS, 0.0)  # wall time of the steps by rows run (each step syncs)
            counts = dict.fromkeys(_STEP_BINS, 0)
            waits = dict.fromkeys(_STEP_BINS, 0.0)  # of which blocked on the GPU's result (graph steps only)
            while not sched.done():
                for rows, decode, wall, waited in self._steps(sched, pool, sampling, uniforms, graphs):
                    key = _step_bin(rows, decode)
                    seconds[key] += wall
                    counts[key] += 1
                    waits[key] += waited
        graph_stats = {k: v - before[k] for k, v in graphs.stats.items()} if graphs is not None else {}
        compiled = compile_cache.report(clock.summary(), log)
        self.stats = dict(sched.stats, num_blocks=pool.num_blocks, kv_bytes=pool.nbytes, pool_kept=kept,
                          resident_pool=self._resident_pool, update_bytes=self.update_bytes or 0,
                          dense_copy_bytes=self.dense_bytes, projection_groups=len(self._groups), **graph_stats,
                          **{f"dense_check_{k}": v for k, v in self.dense_check.items()},
                          humming_bytes=self.humming_bytes, **compiled,
                          **{f"humming_check_{k}": v for k, v in self.humming_check.items()},
                          **{f"step_s_{k}": v for k, v in seconds.items()},
                          **{f"step_wait_s_{k}": v for k, v in waits.items()},
                          **{f"steps_{k}": v for k, v in counts.items()})
        return RolloutOutput(prompt_ids=[p for p in prompts for _ in range(n)],
                             completion_ids=[s.output for s in sched.seqs], logprobs=[s.logprobs for s in sched.seqs],
                             finish_reasons=[s.finish_reason for s in sched.seqs], stats=dict(self.stats))

    def fuse_projections(self, kinds=("fp4", "dense")) -> int:
        """Group the projections of these layer kinds (after ungrouping any); returns the number of groups."""
        self.unfuse_projections()
        self._groups = group_projections(self.model, kinds=tuple(kinds), plain=self.plain_projections)
        return len(self._groups)

    def unfuse_projections(self) -> None:
        """Give the grouped layers their own weights back; later calls run them one by one."""
        self.release()  # dense copies are stacked per group
        ungroup_projections(self._groups)
        self._groups, self._graphs, self._compiled = [], None, None  # graphs: captured with the grouped forwards

    def release(self) -> None:
        """Give the KV pool's and the dense copies' memory back (the next call allocates new ones)."""
        self._release_pool()
        if self.dense_bytes:
            dc.detach_dense_copies(self.model, self._groups)
            self.dense_bytes = 0
        if self.humming_bytes:
            detach_humming_copies(self.model, self._groups)
            self.humming_bytes = 0

    def _release_pool(self) -> None:
        if self.pool is not None:
            self.pool.release()
        self.pool, self._graphs = None, None  # graphs read the pool (and the dense copies) by address
        self._resident_pool = False

    def _full_need(self, prompts, n: int, max_tokens: int) -> int:  # every row at full length + the null block
        return 1 + n * sum(blocks_for(len(p) + max_tokens - 1, self.block_size) for p in prompts)

    def _keep_humming_copies(self, rows: int) -> None:
        """humming's repacked FP4 weights for this call (its GEMMs from HUMMING_MIN_ROWS rows), when they leave
        >= 75% of free memory to the pool; dropped again by release(), so the update gets the memory back."""
        if self.humming_bytes or self.device.type != "cuda" or rows < HUMMING_MIN_ROWS or \
                fp4_humming_mode() == "0" or not humming_fp4.available(self.device):
            return
        need = humming_copy_bytes(self.model, self._groups)
        free = free_device_memory(self.device)
        self.humming_check = dict(need=need, free=free, kept=0 < need <= _DENSE_COPY_FREE_FRACTION * free)
        if self.humming_check["kept"]:
            start = time.perf_counter()
            self.humming_bytes = attach_humming_copies(self.model, self._groups, compute_dtype(self.model), True)
            self.humming_check["build_s"] = time.perf_counter() - start

    def _keep_dense_copies(self, rows: int) -> None:
        if self.dense_weights is False or self.dense_bytes:
            return
        need = dc.dense_copy_bytes(self.model, compute_dtype(self.model))
        if not need:
            return
        if self.dense_weights == "auto":
            if self.device.type == "cpu":  # no FP4 kernel: each call would dequantize its whole weight
                free, kept = dc.host_room(need)
                self.dense_check = dict(need=need, free=free, kept=kept)
                if self.dense_check["kept"]:
                    self.dense_bytes = dc.attach_dense_copies(self.model, self._groups, compute_dtype(self.model))
                return
            if self.device.type != "cuda" or rows < DENSE_COPY_MIN_ROWS:
                self.dense_check = dict(need=need, free=0, kept=False)  # too few rows, or not CUDA
                return
            free = free_device_memory(self.device)
            self.dense_check = dict(need=need, free=free, kept=need <= _DENSE_COPY_FREE_FRACTION * free,
                                    allocated=torch.cuda.memory_allocated(self.device),
                                    reserved=torch.cuda.memory_reserved(self.device))
            if not self.dense_check["kept"]:
                return
        self.dense_bytes = dc.attach_dense_copies(self.model, self._groups, compute_dtype(self.model))

    resident_now = property(lambda self: self.pool is not None and self._resident_pool)  # kept through an update

    def plan_update(self, update_bytes: int | None) -> None:
        """Bytes the policy update needs free between rollouts (residency.update_reserve), for the next pool."""
        self.update_bytes = update_bytes if self.resident == "auto" and self.device.type == "cuda" else None

    def sleep(self) -> None:
        """Between rollouts the pool's memory goes to the update, unless it is resident and the update fits beside."""
        if self.pool is not None and self._resident_pool and self.update_bytes is not None \
                and free_device_memory(self.device) >= self.update_bytes:
            return
        self.release()

    def close(self) -> None:
        self.release()
        self.unfuse_projections()
        self._shadows = {}

    # ---------------------------------------------------------------- one step
    def _graphs_for(self, prompts, sampling: SamplingParams, pool: KVPool) -> DecodeGraphs | None:
        """The bucketed decode steps of this call: the last call's while nothing they depend on changed."""
        if not self.decode_buckets:
            return None
        longest = max(len(p) for p in prompts) + sampling.max_tokens - 1
        width = 1 << (blocks_for(longest, self.block_size) - 1).bit_length()  # power of two: fewer recaptures
        key = (width, sampling_key(sampling), model_signature(self.model), self.lora_dtype, len(self._groups),
               id(pool), pool.key[0].data_ptr() if pool.key else 0)
        if self._graphs is None or self._graphs.key != key:
            self._graphs = None  # free the previous graphs' memory first
            heads = self.model.config.get_text_config().num_attention_heads
            graphed = self.device.type == "cuda" and triton_paged is not None and triton_paged.supported(
                torch.empty(1, heads, pool.head_dim, device=self.device), pool.key[0])
            # a warm-up is valid for the key less the pool, with the same copies attached (they pick the kernels;
            # one warmed on humming, first captured on cuBLAS, loaded kernels mid-capture: H200, FP4 7B, 128 rows)
            warm = (id(self), *key[:5], bool(self.dense_bytes), bool(self.humming_bytes))
            self._graphs = DecodeGraphs(self.model, pool, sampling, width, self.max_num_seqs or _MAX_BUCKET, key,
                                        forward=self._decode_forward(graphed), warm_key=warm)
            self._graphs.capture_ok = graphed  # else the reference's gathers: padded, but not worth a graph
        return self._graphs

    def _decode_forward(self, graphed: bool):
        """The bucketed step's forward: its decoder layers compiled (qerl.rollout.layer_compile: one dynamic-shape
        compile that every layer and bucket reuses) unless turned off."""
        if not (self.compile is True or (self.compile == "auto" and graphed)):
            return None
        if self._compiled is None:
            layers = LayerCompile(self.model, compile_options(self.device))
            self._compiled = functools.partial(compiled_decode_forward, layers) if layers else None
        return self._compiled

    def _steps(self, sched: Scheduler, pool: KVPool, sampling: SamplingParams, uniforms, graphs):
        """One step planned by the scheduler, or a run of decode steps pipelined from it; yields (rows, decode-only,
        wall seconds, seconds blocked on the GPU's result) per step."""
        start = time.perf_counter()
        waited = graphs.stats["graph_wait_s"] if graphs is not None else 0.0
        chunks = sched.schedule()
        decode = _decode_only(chunks)
        if self.pipeline_decode and graphs is not None and decode:
            ran = False
            for rows, wall, wait in pipelined_decode(sched, chunks, graphs, uniforms,
                                                     functools.partial(self._finish_reasons, sampling=sampling),
                                                     self.block_size):
                yield rows, True, wall if ran else time.perf_counter() - start, wait  # the first: with its plan
                ran = True
            if ran:
                return
        rows, decode = self._step(sched, chunks, decode, pool, sampling, uniforms, graphs)
        yield rows, decode, time.perf_counter() - start, \
            (graphs.stats["graph_wait_s"] - waited if graphs is not None else 0.0)

    def _step(self, sched: Scheduler, chunks, decode: bool, pool: KVPool, sampling: SamplingParams, uniforms,
              graphs) -> tuple[int, bool]:
        """One packed forward of the planned chunks, sample where a row reached its last token, update the
        scheduler."""
        if graphs is not None and decode and graphs.bucket(len(chunks)) is not None:
            self._bucketed_step(sched, chunks, sampling, uniforms, graphs)
            return len(chunks), True
        ids = [t for c in chunks for t in c.seq.tokens[c.start:c.end]]
        pos = [p for c in chunks for p in range(c.start, c.end)]
        ends, samplers, last = [], [], 0
        for c in chunks:
            last += c.end - c.start
            if c.samples:
                ends.append(last - 1)
                samplers.append(c.seq)
        meta = PagedMeta.build(pool, [(c.seq.blocks, c.start, c.end) for c in chunks], self.device)
        logits = self._forward(ids, pos, meta, ends)
        sched.commit(chunks)
        if samplers:
            pool.copy_blocks(sched.update(self._sample(sched, samplers, logits, sampling, uniforms)))
        return len(chunks), decode

    def _bucketed_step(self, sched: Scheduler, chunks, sampling: SamplingParams, uniforms, graphs) -> None:
        """A decode-only step through the static buffers (a graph replay on CUDA); no forks can happen here."""
        seqs = [c.seq for c in chunks]
        tok, lp = graphs.run(*step_inputs(chunks, None, uniforms, self.block_size))
        if graphs.compile_failed:
            self.compile = False
        reasons = self._finish_reasons(seqs, tok, sampling)
        sched.commit(chunks)
        copies = sched.update(list(zip(seqs, tok, lp, reasons)))
        assert not copies, "a decode-only step forked a group"

    def _forward(self, ids, pos, meta: PagedMeta, keep) -> torch.Tensor:
        """Logits (len(keep), vocab) in float32 at the packed positions `keep`."""
        dev = self.device
        out = self.model(input_ids=torch.tensor([ids], device=dev), position_ids=torch.tensor([pos], device=dev),
                         attention_mask=None, use_cache=False, qerl_paged=meta,
                         logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev))
        return out.logits[0].float()

    def _sample(self, sched: Scheduler, samplers, logits, sampling: SamplingParams, uniforms) -> list:
        """[(seq, token, logprob, finish reason or None)]; a group's first tokens all come from its prompt's logits."""
        targets = [(seq, i) for i, s in enumerate(samplers) for seq in sched.sampling_rows(s)]
        dev = self.device
        u = None
        if uniforms is not None:
            rows = torch.tensor([s.row for s, _ in targets], device=dev)
            steps = torch.tensor([len(s.output) for s, _ in targets], device=dev)
            u = uniforms[0][rows, steps]
        if len(targets) != len(samplers):  # a fork: the group's rows share their prompt's logits row
            logits = logits[torch.tensor([i for _, i in targets], dtype=torch.long, device=dev)]
        tok, lp = sample_tokens(logits, sampling, u)
        tok, lp = tok.tolist(), lp.tolist()
        reasons = self._finish_reasons([s for s, _ in targets], tok, sampling)
        return [(s, t, p, r) for (s, _), t, p, r in zip(targets, tok, lp, reasons)]

    def _finish_reasons(self, seqs, tokens, sampling: SamplingParams) -> list:
        """"stop" for EOS or a stop string in the decoded tail (as qerl.rollout.sampling.StopChecker), "length"
        at max_tokens, else None."""
        hits = [t in self.eos_ids for t in tokens]
        if sampling.stop:
            window = 2 * max(len(s) for s in sampling.stop) + 2
            tails = [(seq.output + [t])[-window:] for seq, t in zip(seqs, tokens)]
            texts = self.tokenizer.batch_decode(tails, skip_special_tokens=False)
            hits = [h or any(s in text for s in sampling.stop) for h, text in zip(hits, texts)]
        return ["stop" if hit else "length" if len(seq.output) + 1 >= sampling.max_tokens else None
                for seq, hit in zip(seqs, hits)]

    # ---------------------------------------------------------------- the pool
    def _pool_for(self, prompts, n: int, max_tokens: int) -> KVPool:
        if self.num_blocks is None and self.device.type != "cuda":  # CPU: room for every row, no preemption
            need = self._full_need(prompts, n, max_tokens)
            if self.pool is None or self.pool.num_blocks < need:
                self._release_pool()
                self.pool = KVPool(self.model, self.block_size, need)
        elif self.pool is None:
            self._pool_rows = len(prompts) * n  # set only for a pool sized from free memory
            reserve = _forward_reserve(self.model, self.max_num_batched_tokens, self.max_num_seqs, len(prompts) * n)
            blocks = None
            if self.num_blocks is None and self.update_bytes is not None:
                blocks = resident_blocks(self._full_need(prompts, n, max_tokens), free_device_memory(self.device),
                                         self.gpu_memory_utilization, reserve, self.update_bytes,
                                         self.block_size * bytes_per_token(self.model), last=self.stats)
            self.pool = KVPool(self.model, self.block_size, blocks or self.num_blocks, self.gpu_memory_utilization,
                               reserve_bytes=reserve)
            self._resident_pool = blocks is not None
        return self.pool


_STEP_BINS = ("prefill", "decode_1_32", "decode_33_128", "decode_129_512", "decode_513_up")


def _step_bin(rows: int, decode: bool) -> str:
    """The stats bin of one step: any step that prefills, else decode steps by their number of rows."""
    if not decode:
        return "prefill"
    return "decode_1_32" if rows <= 32 else "decode_33_128" if rows <= 128 else \
        "decode_129_512" if rows <= 512 else "decode_513_up"


def _decode_only(chunks) -> bool:
    """Every chunk is one token of a row that samples only for itself (its group already forked)."""
    return all(c.end - c.start == 1 and c.samples and c.seq.group.forked for c in chunks)


def _forward_reserve(model, max_tokens: int, max_seqs: int | None, call_rows: int | None = None) -> int:
    """Rough peak activations of one step of max_tokens tokens, kept out of the KV pool: per token the residual,
    MLP and attention projections (x2 for temporaries), and float32 logits + softmax + sampling buffers per row
    that samples (at most the call's rows: 8,192 rows of a 152k vocabulary would hold back ~20 GB)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    _, kv_heads, head_dim = kv_shape(model)
    itemsize = next(p for p in model.parameters() if p.is_floating_point()).element_size()
    per_token = (4 * cfg.hidden_size + 3 * cfg.intermediate_size
                 + (cfg.num_attention_heads + 2 * kv_heads) * head_dim) * itemsize * 2
    rows = min(max_tokens, max_seqs or max_tokens, call_rows or max_tokens)
    return max_tokens * per_token + rows * cfg.vocab_size * 4 * 4 + _RESERVE_SLACK
