"""CUDA graphs of PagedEngine's decode-only steps: one captured step per batch-size bucket, replayed from static
buffers, so a decode step costs one graph launch instead of hundreds of kernel launches.

    graphs = DecodeGraphs(model, pool, sampling, width=64, max_rows=256)   # keyed; kept across generate calls
    tokens, logprobs = graphs.run(ids, positions, slots, tables, lengths, uniforms)   # B rows of one token each

A step of B rows runs the smallest bucket (1, 2, 4, ..., 256, 384, 512, ...) >= B; padded rows feed token 0 at
position 0 into slot 0 of the null block and attend over it alone (length 1), and their outputs are ignored. One
step = packed forward over [1, bucket] tokens (attention through the Triton paged kernel) + sample_tokens into a
static output buffer, so the sampled token and its log-prob never leave the graph. The first step of a bucket runs
eagerly (Triton compilation, lazy library workspaces), the second captures it; all buckets share one memory pool
(after a failed capture, a fresh one).
A bucket already run eagerly in this process under the same `warm_key` (the key less the pool, with the same weight
copies attached, which pick its kernels: the engine's next rollout, after the update took the pool's memory) is
captured at its first step.
A captured graph reads the weights, the KV pool and the buffers by address: in-place weight updates between calls
are seen, and the key (weights' storage, adapter switches, pool, table width, sampling knobs) says when it is stale.
The host fills pinned staging buffers and copies them with four H2D copies, and reads the outputs with one D2H:
run() waits for them; launch() / collect() let the host plan the next step meanwhile (qerl.rollout.decode_pipeline),
whose tokens come from this step's output on the device.
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings

import torch

from qerl.quant.kernels import humming_fp4
from qerl.quant.kernels.device import decode_step_launches
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
        # token ids, positions, slots, and where a pipelined step takes each row's token from the last step's output
        self.ints = torch.zeros(4, rows, dtype=torch.long, device=dev)
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=dev)
        self.lens = torch.ones(rows, dtype=torch.int32, device=dev)
        self.uniforms = torch.full((rows,), 0.5, dtype=torch.float32, device=dev)
        self.out = torch.zeros(2, rows, dtype=torch.float64, device=dev)  # tokens and log-probs, exact in float64
        pin = dev.type == "cuda"
        # two sets of pinned staging buffers: a pipelined step is staged while the previous one's copies may still
        # be queued behind the step before it (launch / collect)
        self.staging = [_Staging(rows, width, pin) for _ in range(2)]
        self.h_out = [torch.zeros(2, rows, dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.eager_runs: dict[int, int] = {}
        self.mempool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        self.capture_ok = dev.type == "cuda"
        # graph_wait_s: host seconds blocked reading the sampled tokens back (~ the GPU's share of the steps run here)
        self.stats = {"graph_captures": 0, "graph_replays": 0, "graph_eager_steps": 0, "graph_build_s": 0.0,
                      "graph_wait_s": 0.0}

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
        start = time.perf_counter()
        out = self.out[:, :b].cpu()
        self.stats["graph_wait_s"] += time.perf_counter() - start
        return out[0].long().tolist(), out[1].tolist()

    def launch(self, ids, positions, slots, tables, lengths, uniforms, buf: int):
        """Enqueue one decode step without waiting for it (its outputs are read by collect()); None when its bucket
        has no captured graph (a step that must compile, warm up or capture runs through run()). ids: the rows'
        token ids, or, as ("src", indices), each row's token from the previous step's output (its row there):
        that step may still be running. buf: the staging set (alternate between consecutive steps)."""
        b = len(positions)
        size = self.bucket(b)
        on_cuda = self.pool.device.type == "cuda"
        if size is None or (on_cuda and size not in self.graphs):
            return None
        src = ids[1] if isinstance(ids, tuple) else None
        self._stage(b, size, [0] * b if src is not None else ids, positions, slots, tables, lengths, uniforms, buf,
                    src)
        if src is not None:  # the sampled tokens of the step before, still on the device
            self.ints[0, :b].copy_(self.out[0].index_select(0, self.ints[3, :b]))
        if on_cuda:
            self.graphs[size].replay()
            self.stats["graph_replays"] += 1
        else:  # no graphs: the same body, eagerly
            self._body(size)
        self.h_out[buf].copy_(self.out, non_blocking=on_cuda)  # whole: see _stage
        event = None
        if on_cuda:
            event = torch.cuda.Event()
            event.record()
        return b, buf, event

    def collect(self, pending) -> tuple[list[int], list[float]]:
        """The tokens and log-probs of a launched step (blocks until it ran)."""
        b, buf, event = pending
        start = time.perf_counter()
        if event is not None:
            event.synchronize()
        self.stats["graph_wait_s"] += time.perf_counter() - start
        out = self.h_out[buf][:, :b]
        return out[0].long().tolist(), out[1].tolist()

    def _stage(self, b: int, size: int, ids, positions, slots, tables, lengths, uniforms, buf: int = 0,
               src=None) -> None:
        """Fill a set of pinned buffers (rows b..size-1 padded) and copy them to the device buffers."""
        st = self.staging[buf]
        st.ints[:, :size].zero_()
        st.ints[0, :b] = torch.tensor(ids, dtype=torch.long)
        st.ints[1, :b] = torch.tensor(positions, dtype=torch.long)
        st.ints[2, :b] = torch.tensor(slots, dtype=torch.long)
        if src is not None:
            st.ints[3, :b] = torch.tensor(src, dtype=torch.long)
        table = st.table.numpy()
        table[:size] = 0
        for i, blocks in enumerate(tables):
            table[i, :len(blocks)] = blocks
        st.lens[:size] = 1
        st.lens[:b] = torch.tensor(lengths, dtype=torch.int32)
        if uniforms is not None:
            st.uniforms[:b] = torch.as_tensor(uniforms, dtype=torch.float32)
        # whole tensors where a slice would be strided: a strided pinned source is copied through pageable memory,
        # and a pageable copy waits for the stream (a pipelined step would wait for the one in flight)
        self.ints.copy_(st.ints, non_blocking=True)
        self.table[:size].copy_(st.table[:size], non_blocking=True)
        self.lens[:size].copy_(st.lens[:size], non_blocking=True)
        self.uniforms[:size].copy_(st.uniforms[:size], non_blocking=True)

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
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext(), \
                decode_step_launches() if side is not None else contextlib.nullcontext():  # the capture's kernels
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
        stream = torch.cuda.current_stream()
        humming_fp4.wait_pending()  # a kernel that loads while capturing breaks the capture
        try:
            with torch.cuda.graph(graph, pool=self.mempool):
                self._body(size)
        except Exception as exc:  # noqa: BLE001 - any capture failure: decode eagerly from now on
            # a capture that fails in capture_end leaves torch's current stream at its capture stream and its memory
            # pool recording: the next capture into that pool failed with "already recording to mempool_id", so
            # the retry below fell back to eager decoding for good (H200, FP4 7B at 256 rows: 120 ms eager steps)
            torch.cuda.set_stream(stream)
            self.mempool = torch.cuda.graph_pool_handle()
            if self.eager_runs.get(size, 0) == 0:  # captured without this object's warm-up: warm up, capture next
                log.warning("rollout: capturing the %d-row step before running it here failed (%s: %s); running it "
                            "eagerly, capturing it next time", size, type(exc).__name__, str(exc)[:200])
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


class _Staging:
    """Pinned host copies of the step's inputs (token ids, positions, slots, sources; block tables; lengths;
    uniforms)."""

    def __init__(self, rows: int, width: int, pin: bool):
        self.ints = torch.zeros(4, rows, dtype=torch.long, pin_memory=pin)
        self.table = torch.zeros(rows, width, dtype=torch.int32, pin_memory=pin)
        self.lens = torch.ones(rows, dtype=torch.int32, pin_memory=pin)
        self.uniforms = torch.full((rows,), 0.5, dtype=torch.float32, pin_memory=pin)


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
