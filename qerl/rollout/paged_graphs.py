"""CUDA graphs of PagedEngine's decode-only steps: one captured step per batch-size bucket, replayed from static
buffers, so a decode step costs one graph launch instead of hundreds of kernel launches.

    graphs = DecodeGraphs(model, pool, sampling, width=64, max_rows=256)   # keyed; kept across generate calls
    tokens, logprobs = graphs.run(ids, positions, slots, tables, lengths, uniforms)   # B rows of one token each

A step of B rows runs the smallest bucket (1, 2, 4, ..., 256, 384, 512, ...) >= B; padded rows feed token 0 at
position 0 into slot 0 of the null block and attend over it alone (length 1), and their outputs are ignored. One
step = packed forward over [1, bucket] tokens (attention through the Triton paged kernel) + sample_tokens into a
static output buffer, so the sampled token and its log-prob never leave the graph. The first step of a bucket runs
eagerly (Triton compilation, lazy library workspaces), the second captures it; all buckets share one memory pool.
A bucket already run eagerly in this process under the same `warm_key` (the key less the pool: the engine's next
rollout, after the update took the pool's memory) is captured at its first step.
A captured graph reads the weights, the KV pool and the buffers by address: in-place weight updates between calls
are seen, and the key (weights' storage, adapter switches, pool, table width, sampling knobs) says when it is stale.
The host fills pinned staging buffers and copies them with three H2D copies, and reads the outputs with one D2H.
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings

import torch

from qerl.rollout.paged_attention import PagedMeta, paged_step
from qerl.rollout.sampling import sample_tokens

log = logging.getLogger("qerl.rollout.paged")
_SLOW_BUILD_S = 1.0  # a build step slower than this is logged: it compiled something (the layers' code, kernels)
_WARMED: set = set()  # (warm_key, bucket) run eagerly in this process: its kernels are compiled, workspaces exist


def bucket_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, ..., 256, then steps of 128, up to the first bucket >= max_rows."""
    sizes, b = [], 1
    while True:
        sizes.append(b)
        if b >= max_rows:
            return sizes
        b = b * 2 if b < 256 else b + 128


class DecodeGraphs:
    """Static buffers sized for the largest bucket, and the graphs captured so far (bucket -> CUDAGraph)."""

    def __init__(self, model, pool, sampling, width: int, max_rows: int, key, forward=None, warm_key=None):
        dev = pool.device
        self.model, self.pool, self.sampling, self.key = model, pool, sampling, key
        self.warm_key = warm_key
        self.forward = forward or decode_forward  # a torch.compile'd decode_forward, or it
        self.compile_failed = False
        self.buckets = bucket_sizes(max_rows)
        rows = self.buckets[-1]
        self.ints = torch.zeros(3, rows, dtype=torch.long, device=dev)  # token ids, positions, slots
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=dev)
        self.lens = torch.ones(rows, dtype=torch.int32, device=dev)
        self.uniforms = torch.full((rows,), 0.5, dtype=torch.float32, device=dev)
        self.out = torch.zeros(2, rows, dtype=torch.float64, device=dev)  # tokens and log-probs, exact in float64
        pin = dev.type == "cuda"
        self.h_ints = torch.zeros(3, rows, dtype=torch.long, pin_memory=pin)
        self.h_table = torch.zeros(rows, width, dtype=torch.int32, pin_memory=pin)
        self.h_lens = torch.ones(rows, dtype=torch.int32, pin_memory=pin)
        self.h_uniforms = torch.full((rows,), 0.5, dtype=torch.float32, pin_memory=pin)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.eager_runs: dict[int, int] = {}
        self.mempool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        self.capture_ok = dev.type == "cuda"
        self.stats = {"graph_captures": 0, "graph_replays": 0, "graph_eager_steps": 0, "graph_build_s": 0.0}

    @property
    def width(self) -> int:
        return self.table.shape[1]

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding `rows`, or None when there are more rows than the largest bucket."""
        return next((b for b in self.buckets if b >= rows), None)

    def run(self, ids, positions, slots, tables, lengths, uniforms) -> tuple[list[int], list[float]]:
        """One decode step of len(ids) rows (lists on the host; tables: each row's block ids, at most `width`)."""
        b = len(ids)
        size = self.bucket(b)
        self._stage(b, size, ids, positions, slots, tables, lengths, uniforms)
        if size in self.graphs:
            self.graphs[size].replay()
            self.stats["graph_replays"] += 1
        else:  # host seconds of steps that compile, warm up or capture (no device sync: launch-side cost)
            start = time.perf_counter()
            warmed = self.warm_key is not None and (self.warm_key, size) in _WARMED
            if (self.eager_runs.get(size, 0) == 0 and not warmed) or not self.capture_ok:
                self._eager(size)
            else:
                self._capture(size)
            seconds = time.perf_counter() - start
            self.stats["graph_build_s"] += seconds
            if seconds > _SLOW_BUILD_S:
                log.info("rollout: the decode step of %d rows %s in %.1f s (first use: torch.compile of the decoder "
                         "layers, Triton/humming kernels)", size, "ran eagerly" if size not in self.graphs
                         else "was captured", seconds)
        out = self.out[:, :b].cpu()
        return out[0].long().tolist(), out[1].tolist()

    def _stage(self, b: int, size: int, ids, positions, slots, tables, lengths, uniforms) -> None:
        """Fill the pinned buffers (rows b..size-1 padded) and copy them to the device buffers."""
        self.h_ints[:, :size].zero_()
        self.h_ints[0, :b] = torch.tensor(ids, dtype=torch.long)
        self.h_ints[1, :b] = torch.tensor(positions, dtype=torch.long)
        self.h_ints[2, :b] = torch.tensor(slots, dtype=torch.long)
        table = self.h_table.numpy()
        table[:size] = 0
        for i, blocks in enumerate(tables):
            table[i, :len(blocks)] = blocks
        self.h_lens[:size] = 1
        self.h_lens[:b] = torch.tensor(lengths, dtype=torch.int32)
        if uniforms is not None:
            self.h_uniforms[:b] = torch.as_tensor(uniforms, dtype=torch.float32)
        self.ints[:, :size].copy_(self.h_ints[:, :size], non_blocking=True)
        self.table[:size].copy_(self.h_table[:size], non_blocking=True)
        self.lens[:size].copy_(self.h_lens[:size], non_blocking=True)
        self.uniforms[:size].copy_(self.h_uniforms[:size], non_blocking=True)

    def _body(self, size: int) -> None:
        meta = PagedMeta.decode_step(self.pool, self.ints[2, :size], self.table[:size], self.lens[:size])
        logits = self.forward(self.model, self.ints[0, :size], self.ints[1, :size], meta)
        u = None if self.sampling.greedy else self.uniforms[:size]
        tok, lp = sample_tokens(logits, self.sampling, u)
        self.out[0, :size].copy_(tok)
        self.out[1, :size].copy_(lp)

    def _eager(self, size: int) -> None:
        """The step without a graph (on CUDA on a side stream, as a later capture wants its warm-up)."""
        self.eager_runs[size] = self.eager_runs.get(size, 0) + 1
        self.stats["graph_eager_steps"] += 1
        if self.warm_key is not None:
            _WARMED.add((self.warm_key, size))
        side = torch.cuda.Stream() if self.capture_ok else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            try:
                self._body(size)
            except Exception as exc:  # noqa: BLE001 - a compile failure: the step again, uncompiled (idempotent)
                if self.forward is decode_forward:
                    raise
                warnings.warn(f"PagedEngine: torch.compile failed ({type(exc).__name__}: {exc}); decoding without it",
                              RuntimeWarning, stacklevel=3)
                self.forward, self.compile_failed = decode_forward, True
                self._body(size)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)

    def _capture(self, size: int) -> None:
        """Capture the step (which records without running it), then replay it once for this step's outputs."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.mempool):
                self._body(size)
        except Exception as exc:  # noqa: BLE001 - any capture failure: decode eagerly from now on
            if self.eager_runs.get(size, 0) == 0:  # captured without this object's warm-up: warm up, capture next
                _WARMED.discard((self.warm_key, size))
                self._eager(size)
                return
            warnings.warn(f"PagedEngine: CUDA-graph capture failed ({type(exc).__name__}: {exc}); decoding eagerly",
                          RuntimeWarning, stacklevel=3)
            self.capture_ok = False
            self._eager(size)
            return
        self.graphs[size] = graph
        self.stats["graph_captures"] += 1
        graph.replay()
        self.stats["graph_replays"] += 1


def decode_forward(model, ids: torch.Tensor, positions: torch.Tensor, meta: PagedMeta) -> torch.Tensor:
    """Float32 logits (rows, vocab) of a packed step of one token per row."""
    with paged_step(meta):
        out = model(input_ids=ids[None], position_ids=positions[None], attention_mask=None, use_cache=False,
                    logits_to_keep=0)
    return out.logits[0].float()


def compiled_decode_forward(layers, model, ids: torch.Tensor, positions: torch.Tensor, meta: PagedMeta):
    """decode_forward with the decoder layers' compiled calls (a qerl.rollout.layer_compile.LayerCompile)."""
    with layers.active():
        return decode_forward(model, ids, positions, meta)
