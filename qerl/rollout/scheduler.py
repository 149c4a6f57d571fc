"""Continuous batching over a block pool: which tokens each model step computes, for which rows (no tensors here).

    sched = Scheduler(prompts, n=8, max_tokens=256, allocator=BlockAllocator(pool.num_blocks), block_size=16)
    while not sched.done():
        chunks = sched.schedule()            # [Chunk(seq, start, end)]: compute seq.tokens[start:end]
        ... one packed forward writing K/V at each chunk's slots; sample where chunk.samples ...
        sched.commit(chunks)
        copies = sched.update([(seq, token, logprob, finish_reason_or_None), ...])
        pool.copy_blocks(copies)             # a group's prompt just computed: its n rows forked

One step spends a token budget (`max_num_batched_tokens`) on running rows first (decode = 1 token, or the next chunk
of a prefill), in admission order; a row that needs a new block when none is free preempts the most recently
admitted running row (LIFO, as vLLM): its blocks are freed and it goes back to the front of the waiting queue with
its tokens and log-probs kept, to be recomputed (prompt + generated tokens) later. Then, unless something was
preempted, waiting rows are admitted in row order while budget, `max_num_seqs` and free blocks last.

Prefix sharing: only the first row of a group (a prompt's n samples) is prefilled; when its prompt is complete its
n rows sample their first tokens from the same logits and fork: the prompt's full blocks are shared (ref-counted)
and the partial last block is copied into a fresh block per row (copy-on-write). A recomputed row re-attaches to its
group's full prompt blocks while any row of the group still holds them. Nothing outlives a call: the weights change
in place between calls, so KV computed by an earlier call is never reused.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qerl.errors import QerlError

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Group:
    """One prompt and its n rows; `shared` = its full prompt blocks in the pool while any row in `holders` has them."""

    prompt_len: int
    rows: list = field(default_factory=list)
    forked: bool = False
    shared: list = field(default_factory=list)
    holders: set = field(default_factory=set)


@dataclass(eq=False)
class Seq:
    """One output row: tokens = prompt + generated; KV of tokens[:num_computed] lives in `blocks`."""

    row: int
    group: Group
    tokens: list
    output: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    num_computed: int = 0
    status: str = WAITING
    finish_reason: str | None = None


@dataclass(frozen=True)
class Chunk:
    """Compute seq.tokens[start:end] (positions start..end-1) this step."""

    seq: Seq
    start: int
    end: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the row's last known token, so its logits give the next token."""
        return self.end == len(self.seq.tokens)


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


def check_fits(prompts, max_tokens: int, block_size: int, num_blocks: int) -> None:
    """One QerlError line, before any work, if the longest row alone cannot fit the pool."""
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    length = len(prompts[longest])
    need = blocks_for(length + max_tokens - 1, block_size)  # the last sampled token is never fed back
    usable = num_blocks - 1
    if need > usable:
        raise QerlError(
            f"rollout: prompt {longest} ({length} tokens) + max_tokens {max_tokens} needs {need} KV blocks of "
            f"{block_size} tokens but the pool has {usable}; lower max_prompt_length + max_completion_length or "
            f"raise gpu_memory_utilization (or num_blocks)")


class Scheduler:
    """The rows of one generate call (prompt-major, n per prompt) and their progress; see the module docstring.

    watermark: fraction of the pool kept free when admitting a row while others run (at least one block), so that
    running rows can take their next block without preempting the row just admitted."""

    def __init__(self, prompts, n: int, max_tokens: int, allocator, block_size: int,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int | None = None, watermark: float = 0.01):
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise QerlError(f"max_num_batched_tokens: expected an int >= 1, got {max_num_batched_tokens!r}")
        if max_num_seqs is not None and (not isinstance(max_num_seqs, int) or max_num_seqs < 1):
            raise QerlError(f"max_num_seqs: expected None or an int >= 1, got {max_num_seqs!r}")
        self.alloc, self.block_size, self.max_tokens = allocator, block_size, max_tokens
        self.budget, self.max_num_seqs = max_num_batched_tokens, max_num_seqs or float("inf")
        self.watermark = max(1, int(watermark * allocator.num_usable))  # spare blocks kept when admitting
        self.groups, self.seqs = [], []
        for prompt in prompts:
            group = Group(prompt_len=len(prompt), forked=n == 1)
            group.rows = [Seq(row=len(self.seqs) + j, group=group, tokens=list(prompt)) for j in range(n)]
            self.groups.append(group)
            self.seqs += group.rows
        self.waiting = deque(g.rows[0] for g in self.groups)  # siblings start at their group's fork
        self.running: list[Seq] = []
        self.unfinished = len(self.seqs)
        # prefill_tokens: prompt positions computed (again after a preemption); decode_tokens: all other positions
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "preemptions": 0, "forks": 0,
                      "fork_fallbacks": 0, "reattached": 0, "peak_running": 0, "peak_blocks": 0}

    # ---------------------------------------------------------------- planning
    def done(self) -> bool:
        return self.unfinished == 0

    def schedule(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        budget, preempted = self._schedule_running(self.budget, chunks)
        if not preempted:
            self._admit_waiting(budget, chunks)
        if not chunks:  # cannot happen while check_fits holds: a lone row always fits
            raise RuntimeError("Scheduler: nothing could be scheduled although rows are unfinished")
        self.stats["steps"] += 1
        self.stats["peak_running"] = max(self.stats["peak_running"], len(self.running))
        self.stats["peak_blocks"] = max(self.stats["peak_blocks"], self.alloc.num_usable - self.alloc.num_free)
        return chunks

    def _schedule_running(self, budget: int, chunks: list) -> tuple[int, bool]:
        """Next chunk of every running row in admission order, preempting from the back when blocks run out."""
        preempted, i = False, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            end = min(len(seq.tokens), seq.num_computed + budget)
            while not self._grow(seq, end):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    return budget, preempted
            chunks.append(Chunk(seq, seq.num_computed, end))
            budget -= end - seq.num_computed
            i += 1
        return budget, preempted

    def next_decode(self, chunks, in_flight: int = 1) -> list[Chunk] | None:
        """The decode step after `chunks` (one token per row) planned before their tokens are known: every row of
        it not finished yet and not at max_tokens once `in_flight` more tokens are counted, one position on, its
        block grown. None when a row finds no free block (the caller drains and lets schedule() preempt) or when a
        row waits: admitting it is schedule()'s. Rows that end with the step in flight decode once more in vain;
        update() ends them and commit() of the next step must leave them out (it does: see commit)."""
        if self.waiting:
            return None
        nxt = []
        for c in chunks:
            seq = c.seq
            if seq.status != RUNNING or len(seq.output) + in_flight >= self.max_tokens:
                continue
            if not self._grow(seq, c.end + 1):
                return None
            nxt.append(Chunk(seq, c.end, c.end + 1))
        return nxt

    def count_step(self) -> None:
        """A step planned by next_decode was launched: the stats schedule() keeps for its own steps."""
        self.stats["steps"] += 1
        self.stats["peak_blocks"] = max(self.stats["peak_blocks"], self.alloc.num_usable - self.alloc.num_free)

    def _admit_waiting(self, budget: int, chunks: list) -> None:
        """Admit waiting rows in order (preempted rows first) while budget, row cap and blocks last."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            shared = seq.group.shared
            start = len(shared) * self.block_size
            end = min(len(seq.tokens), start + budget)
            spare = self.watermark if self.running else 0  # a lone row may use the whole pool
            need = blocks_for(end, self.block_size) - len(shared)
            if self.alloc.num_free < need + spare:
                return
            self.waiting.popleft()
            self.alloc.share(shared)
            seq.blocks = list(shared) + self.alloc.alloc(need)
            seq.num_computed = start
            if shared:
                seq.group.holders.add(seq.row)
                self.stats["reattached"] += 1
            seq.status = RUNNING
            self.running.append(seq)
            chunks.append(Chunk(seq, start, end))
            budget -= end - start

    def _grow(self, seq: Seq, end: int) -> bool:
        """Blocks for positions < end, all or nothing."""
        need = blocks_for(end, self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        ids = self.alloc.alloc(need)
        if ids is None:
            return False
        seq.blocks += ids
        return True

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = WAITING
        self.waiting.appendleft(seq)
        self.stats["preemptions"] += 1

    def _release(self, seq: Seq) -> None:
        self.alloc.free(seq.blocks)
        seq.blocks, seq.num_computed = [], 0
        group = seq.group
        group.holders.discard(seq.row)
        if not group.holders:  # the last holder dropped them: their ids may be handed out again
            group.shared = []

    # ---------------------------------------------------------------- after the forward
    def commit(self, chunks) -> None:
        """The chunks' K/V are in the pool now; a row past its full prompt blocks offers them to its group. Chunks
        of rows that ended meanwhile (a step planned ahead by next_decode) are left out."""
        for c in chunks:
            seq, group = c.seq, c.seq.group
            if seq.status == FINISHED:
                continue
            prompt_part = max(0, min(c.end, group.prompt_len) - c.start)
            self.stats["prefill_tokens"] += prompt_part
            self.stats["decode_tokens"] += c.end - c.start - prompt_part
            seq.num_computed = c.end
            full = group.prompt_len // self.block_size
            if not group.shared and full and c.end >= full * self.block_size:
                group.shared = seq.blocks[:full]
                group.holders = {seq.row}

    def sampling_rows(self, seq: Seq) -> list[Seq]:
        """Rows whose next token comes from this row's logits: the whole group when its prompt was just computed."""
        group = seq.group
        if not group.forked and seq is group.rows[0]:
            return list(group.rows)
        return [seq]

    def update(self, results) -> list[tuple[int, int]]:
        """Record this step's samples [(seq, token, logprob, finish reason or None)], end finished rows and fork the
        groups whose prompt was just computed; returns the (src, dst) blocks the pool must copy before the next step.
        Order matters: siblings ending on their first token never get blocks, and a first row ending on its first
        token keeps its prompt blocks until its siblings forked from them."""
        ends, forking = [], {}
        for seq, token, logprob, reason in results:
            seq.output.append(token)
            seq.logprobs.append(logprob)
            seq.tokens.append(token)
            if not seq.group.forked:
                forking[id(seq.group)] = seq.group
            if reason is not None:
                ends.append((seq, reason))
        for seq, reason in ends:
            if seq.group.forked or seq is not seq.group.rows[0]:
                self._finish(seq, reason)
        copies = [pair for group in forking.values() for pair in self._fork(group)]
        for seq, reason in ends:
            if seq.status != FINISHED:
                self._finish(seq, reason)
        return copies

    def _fork(self, group: Group) -> list[tuple[int, int]]:
        """Give the group's other unfinished rows the first row's prompt KV; returns the (src, dst) blocks to copy.

        A row that finds no free block (or no room under max_num_seqs) waits and recomputes instead."""
        group.forked = True
        leader = group.rows[0]
        full, part = divmod(group.prompt_len, self.block_size)
        copies, late = [], []
        for seq in group.rows[1:]:
            if seq.status == FINISHED:
                continue
            dst = self.alloc.alloc(1 if part else 0) if len(self.running) < self.max_num_seqs else None
            if dst is None:
                late.append(seq)
                continue
            self.alloc.share(leader.blocks[:full])
            seq.blocks = leader.blocks[:full] + dst
            copies += [(leader.blocks[full], dst[0])] if part else []
            seq.num_computed, seq.status = group.prompt_len, RUNNING
            group.holders.add(seq.row)
            self.running.append(seq)
            self.stats["forks"] += 1
        self.waiting.extendleft(reversed(late))
        self.stats["fork_fallbacks"] += len(late)
        return copies

    def _finish(self, seq: Seq, reason: str) -> None:
        """The row is complete: its blocks go back at once (shared ones when their last holder ends)."""
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status, seq.finish_reason = FINISHED, reason
        self.unfinished -= 1
