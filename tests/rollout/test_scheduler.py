"""The scheduler driven without a model: a fake pool stores, per slot, the token prefix whose K/V it would hold, so
every step checks that each row reads exactly its own prefix (block tables, sharing, copy-on-write, preemption)."""
from __future__ import annotations

import random

import pytest

from qerl.errors import QerlError
from qerl.rollout.kv_pool import BlockAllocator
from qerl.rollout.scheduler import RUNNING, Scheduler, check_fits


class FakePool:
    """slot -> the token prefix whose last position's K/V it holds (K/V depends on the whole prefix)."""

    def __init__(self, block_size: int):
        self.bs, self.slots = block_size, {}

    def slot(self, seq, p: int) -> int:
        return seq.blocks[p // self.bs] * self.bs + p % self.bs

    def step(self, sched, chunks) -> None:
        for c in chunks:
            seq = c.seq
            for p in range(c.start, c.end):
                assert sched.alloc.ref_count(seq.blocks[p // self.bs]) == 1, "a write into a shared block"
                self.slots[self.slot(seq, p)] = tuple(seq.tokens[:p + 1])
        for c in chunks:  # attention reads every key position of the row after the step's writes
            for p in range(c.end):
                assert self.slots.get(self.slot(c.seq, p)) == tuple(c.seq.tokens[:p + 1])

    def copy_blocks(self, pairs) -> None:
        for src, dst in pairs:
            for i in range(self.bs):
                self.slots[dst * self.bs + i] = self.slots.get(src * self.bs + i)


def next_token(seq) -> int:
    """A deterministic 'model': the next token depends on the row and its length only."""
    return (seq.row * 31 + len(seq.tokens) * 7) % 50 + 1


def drive(sched: Scheduler, pool: FakePool, stop_token: int | None = None, ends=None, max_steps: int = 10_000):
    """Run a call to the end as PagedEngine does (ends: row -> output length at which it stops); returns the chunk
    lists of every step."""
    ends = ends or {}
    steps = []
    while not sched.done():
        assert len(steps) < max_steps
        chunks = sched.schedule()
        pool.step(sched, chunks)
        sched.commit(chunks)
        results = []
        for c in chunks:
            if c.samples:
                for seq in sched.sampling_rows(c.seq):
                    tok = next_token(seq) if seq.output or seq is c.seq else next_token(c.seq) + seq.row
                    stops = tok == stop_token or len(seq.output) + 1 == ends.get(seq.row)
                    end = "stop" if stops else "length" if len(seq.output) + 1 == sched.max_tokens else None
                    results.append((seq, tok, -1.0, end))
        pool.copy_blocks(sched.update(results))
        steps.append(chunks)
    return steps


def make(prompts, n, max_tokens, num_blocks, block_size=4, **kw):
    alloc = BlockAllocator(num_blocks)
    return Scheduler(prompts, n, max_tokens, alloc, block_size, **kw), FakePool(block_size)


PROMPTS = [list(range(100, 110)), list(range(200, 203)), list(range(300, 308))]  # 10, 3 and 8 tokens


def outputs(sched):
    return [(s.output, s.finish_reason) for s in sched.seqs]


def test_prompt_prefilled_once_per_group_and_rows_forked():
    sched, pool = make(PROMPTS, n=4, max_tokens=6, num_blocks=64)
    steps = drive(sched, pool)
    assert sched.stats["prefill_tokens"] == sum(map(len, PROMPTS))  # each prompt once, not once per row
    assert sched.stats["forks"] == 3 * 3 and sched.stats["preemptions"] == 0
    first = {(c.seq.row, c.start, c.end) for c in steps[0]}
    assert first == {(0, 0, 10), (4, 0, 3), (8, 0, 8)}  # only each group's first row is prefilled
    assert all(len(s.output) == 6 and s.finish_reason == "length" for s in sched.seqs)
    assert sched.alloc.all_free()


def test_fork_shares_full_prompt_blocks_and_copies_the_partial_one():
    sched, pool = make([list(range(10))], n=3, max_tokens=4, num_blocks=16)
    chunks = sched.schedule()
    sched.commit(chunks)
    leader = sched.seqs[0]
    copies = sched.update([(s, 7, -1.0, None) for s in sched.sampling_rows(leader)])
    full, partial = leader.blocks[:2], leader.blocks[2]
    assert [sched.alloc.ref_count(b) for b in full] == [3, 3] and sched.alloc.ref_count(partial) == 1
    assert [src for src, _ in copies] == [partial, partial]
    assert all(s.blocks[:2] == full and s.num_computed == 10 and s.status == RUNNING for s in sched.seqs[1:])
    assert len({s.blocks[2] for s in sched.seqs}) == 3  # each row writes its own partial block


def test_block_aligned_prompt_forks_without_copies():
    sched, _ = make([list(range(8))], n=2, max_tokens=4, num_blocks=16)
    sched.commit(chunks := sched.schedule())
    copies = sched.update([(s, 7, -1.0, None) for s in sched.sampling_rows(chunks[0].seq)])
    assert copies == [] and sched.seqs[1].blocks == sched.seqs[0].blocks


def test_small_pool_preempts_newest_first_and_gives_the_same_rows():
    free, pool = make(PROMPTS, n=3, max_tokens=12, num_blocks=256)
    drive(free, pool)
    tight, pool = make(PROMPTS, n=3, max_tokens=12, num_blocks=9)
    drive(tight, pool)  # FakePool checks every read against the row's own prefix, through recomputes
    assert tight.stats["preemptions"] > 0 and tight.stats["peak_blocks"] <= 8
    assert outputs(tight) == outputs(free)
    assert tight.alloc.all_free()


def test_victim_is_the_most_recently_admitted_row():
    sched, pool = make([list(range(4)), list(range(10, 14))], n=1, max_tokens=8, num_blocks=5)
    for _ in range(2):  # both rows admitted, prefilled (one block each) and given their second block
        chunks = sched.schedule()
        pool.step(sched, chunks)
        sched.commit(chunks)
        sched.update([(c.seq, 1, -1.0, None) for c in chunks])
    assert [s.row for s in sched.running] == [0, 1] and sched.alloc.num_free == 0
    for _ in range(4):  # positions 5..7 fit the second blocks; position 8 needs a third
        chunks = sched.schedule()
        pool.step(sched, chunks)
        sched.commit(chunks)
        sched.update([(c.seq, 1, -1.0, None) for c in chunks])
    assert sched.stats["preemptions"] == 1  # row 0 needed a third block: row 1 (admitted last) gave way
    assert [s.row for s in sched.running] == [0] and sched.waiting[0].row == 1
    assert sched.seqs[1].output == [1] * 5 and sched.seqs[1].blocks == []  # tokens kept, blocks freed


def test_recomputed_row_reattaches_to_its_groups_prompt_blocks():
    prompts = [list(range(9)), list(range(50, 54))]  # the first: two full blocks and one token
    ends = {2: 2, 3: 2}  # the second prompt's rows stop early, so a preempted row returns while its sibling runs
    free, pool = make(prompts, n=2, max_tokens=10, num_blocks=64)
    drive(free, pool, ends=ends)
    sched, pool = make(prompts, n=2, max_tokens=10, num_blocks=6)
    drive(sched, pool, ends=ends)  # FakePool: the shared blocks hold exactly the recomputed row's prompt
    assert sched.stats["preemptions"] > 0 and sched.stats["reattached"] > 0
    assert outputs(sched) == outputs(free) and sched.alloc.all_free()


def test_random_schedules_give_the_unconstrained_rows():
    """Random pools, budgets, row caps and early stops: reads always see the row's own prefix, rows equal an
    unconstrained run, every block comes back."""
    rng = random.Random(0)
    seen = {"preemptions": 0, "reattached": 0, "fork_fallbacks": 0}
    for _ in range(150):
        bs, n, max_tokens = rng.choice([1, 3, 4, 8]), rng.randint(1, 4), rng.randint(1, 10)
        prompts = [list(range(100 * i, 100 * i + rng.randint(1, 12))) for i in range(rng.randint(1, 4))]
        num_blocks = rng.randint(2, 24)
        try:
            check_fits(prompts, max_tokens, bs, num_blocks)
        except QerlError:
            continue
        ends = {r: rng.randint(1, max_tokens) for r in range(len(prompts) * n) if rng.random() < 0.3}
        ref, pool = make(prompts, n, max_tokens, num_blocks=512, block_size=bs)
        drive(ref, pool, ends=ends)
        sched, pool = make(prompts, n, max_tokens, num_blocks, block_size=bs,
                           max_num_batched_tokens=rng.choice([1, 2, 5, 64]), max_num_seqs=rng.choice([None, 1, 3]))
        drive(sched, pool, ends=ends)
        assert outputs(sched) == outputs(ref) and sched.alloc.all_free()
        for k in seen:
            seen[k] += sched.stats[k]
    assert all(seen.values())  # the paths under test were taken


def test_fork_without_a_free_block_recomputes_later():
    sched, pool = make([list(range(6))], n=3, max_tokens=3, num_blocks=4)  # 2 blocks per row, 3 usable
    drive(sched, pool)
    assert sched.stats["fork_fallbacks"] >= 1
    assert all(len(s.output) == 3 for s in sched.seqs) and sched.alloc.all_free()


def test_chunked_prefill_and_row_cap():
    ref, pool = make(PROMPTS, n=2, max_tokens=5, num_blocks=64)
    drive(ref, pool)
    sched, pool = make(PROMPTS, n=2, max_tokens=5, num_blocks=64, max_num_batched_tokens=3, max_num_seqs=2)
    steps = drive(sched, pool)
    assert all(sum(c.end - c.start for c in chunks) <= 3 for chunks in steps)
    assert max(len(chunks) for chunks in steps) <= 2 and outputs(sched) == outputs(ref)


def test_rows_that_stop_free_their_blocks_at_once():
    sched, pool = make(PROMPTS, n=2, max_tokens=20, num_blocks=64)
    stop = next_token(sched.seqs[2]) + 0  # whatever row 2 would say at some point ends it
    drive(sched, pool, stop_token=stop)
    assert any(s.finish_reason == "stop" for s in sched.seqs) and sched.alloc.all_free()


def test_check_fits_names_the_row_blocks_and_knobs():
    check_fits(PROMPTS, max_tokens=7, block_size=4, num_blocks=5)  # 10 + 7 - 1 positions = 4 blocks: fits
    with pytest.raises(QerlError) as err:
        check_fits(PROMPTS, max_tokens=8, block_size=4, num_blocks=5)
    msg = str(err.value)
    assert "\n" not in msg and "prompt 0 (10 tokens) + max_tokens 8 needs 5 KV blocks" in msg
    assert "pool has 4" in msg and "max_prompt_length + max_completion_length" in msg
    assert "gpu_memory_utilization" in msg


def test_bad_knobs_raise_one_line_errors():
    for kw, field in ((dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
                      (dict(max_num_seqs=0), "max_num_seqs")):
        with pytest.raises(QerlError, match=field):
            make(PROMPTS, n=1, max_tokens=4, num_blocks=8, **kw)
