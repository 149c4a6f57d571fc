"""PagedEngine's decode-only steps with one step in flight: the host plans, stages and launches step N+1 while
the GPU runs step N, and reads step N's tokens only then.

    for rows, wall_s, wait_s in pipelined_decode(sched, chunks, graphs, uniforms, finish_reasons, block_size):
        ...   # one entry per step, once its tokens are read and the scheduler updated

Step N+1 takes each row's token from step N's output on the device (DecodeGraphs.launch with sources), so the
host never waits for a token before launching the next step. What the host cannot know in advance is whether a
row ended at step N (EOS or a stop string): such a row decodes once more in vain, its token is dropped and its
blocks are freed as the next step's results come in (the pool's stream order keeps that write before any later
owner's). Rows at max_tokens are known ahead and left out. The run stops (the caller's synchronous steps take
over, after the step in flight was read) when rows wait for admission, a row finds no free block (schedule()
preempts) or the next step's bucket has no captured graph yet. Rows get the same tokens and log-probs as the
synchronous steps: the same uniforms (seed, row, token index), the same bucketed forward.
"""
from __future__ import annotations

import time

from qerl.rollout.scheduler import FINISHED, Scheduler


def pipelined_decode(sched: Scheduler, chunks, graphs, uniforms, finish_reasons, block_size: int):
    """Run decode steps from `chunks` (a decode-only step that schedule() just planned) while they can be planned
    ahead; yields (rows, wall seconds, seconds blocked on the GPU) per step read. Yields nothing when the first
    step cannot be launched this way (its bucket has no graph yet): the caller runs it synchronously."""
    start = time.perf_counter()
    pending = graphs.launch(*step_inputs(chunks, None, uniforms, block_size), buf=0)
    if pending is None:
        return
    buf = 0
    while pending is not None:
        nxt = sched.next_decode(chunks)
        nxt_pending = None
        if nxt:
            nxt_pending = graphs.launch(*step_inputs(nxt, chunks, uniforms, block_size), buf=buf ^ 1)
            if nxt_pending is not None:
                sched.count_step()
                buf ^= 1
        waited = graphs.stats["graph_wait_s"]
        tokens, logprobs = graphs.collect(pending)
        live = [i for i, c in enumerate(chunks) if c.seq.status != FINISHED]  # ended while this step ran
        seqs = [chunks[i].seq for i in live]
        tokens, logprobs = [tokens[i] for i in live], [logprobs[i] for i in live]
        reasons = finish_reasons(seqs, tokens)
        sched.commit(chunks)
        copies = sched.update(list(zip(seqs, tokens, logprobs, reasons)))
        assert not copies, "a decode-only step forked a group"
        now = time.perf_counter()
        yield len(chunks), now - start, graphs.stats["graph_wait_s"] - waited
        start = now
        if nxt_pending is None:
            return
        chunks, pending = nxt, nxt_pending


def step_inputs(chunks, previous, uniforms, block_size: int):
    """DecodeGraphs.run's / launch's inputs for these decode chunks: token ids from the host for a step planned by
    schedule() (previous None), else each row's index in the previous step (its token is still on the device)."""
    seqs = [c.seq for c in chunks]
    pos = [c.start for c in chunks]
    if previous is None:
        ids = [s.tokens[p] for s, p in zip(seqs, pos)]
        ahead = 0
    else:
        index = {id(c.seq): i for i, c in enumerate(previous)}
        ids = ("src", [index[id(s)] for s in seqs])
        ahead = 1  # the previous step's token is not in seq.output yet
    u = None if uniforms is None else uniforms[1][[s.row for s in seqs], [len(s.output) + ahead for s in seqs]]
    slots = [s.blocks[p // block_size] * block_size + p % block_size for s, p in zip(seqs, pos)]
    return ids, pos, slots, [s.blocks for s in seqs], [p + 1 for p in pos], u
