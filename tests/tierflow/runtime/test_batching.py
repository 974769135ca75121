"""The step batcher: grouping, stacking and splitting, and batches of a real decoder that
answer each step bit for bit as it runs alone ([Note: batching exactness]).

A batch forms when steps queue behind a running call; the tests make that happen without
timing: the first call, inside the batcher, submits the other steps from threads and waits
until they have queued, so what the batcher does next is fixed, not a race.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

from tierflow.errors import DeadlineError, InputError, ModelError
from tierflow.options import RuntimeOptions
from tierflow.runtime.batching import (
    IN_PLACE_BYTES,
    Padding,
    Pending,
    StepBatcher,
    group_key,
    pad,
    row_order,
    split,
    stack,
    unpad,
)
from tierflow.runtime.segment_runner import SegmentRunner
from tierflow.runtime.workers import WorkerSlots
from tierflow.zoo.tiny_stateful import tiny_decoder

BLOCKS = 2
WIDTH = 8
VOCAB = 16


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> SegmentRunner:
    path = tiny_decoder(
        tmp_path_factory.mktemp("batch") / "d.onnx", blocks=BLOCKS, width=WIDTH, vocab=VOCAB
    )
    return SegmentRunner(path, RuntimeOptions())


def step(past: int, token: int, seed: int, seq: int = 1) -> dict[str, np.ndarray]:
    """One session's decode step after ``past`` tokens, with a random KV cache."""
    rng = np.random.default_rng(seed)
    feeds = {
        "input_ids": np.full((1, seq), token, dtype=np.int64),
        "attention_mask": np.ones((1, past + seq), dtype=np.int64),
        "position_ids": np.arange(past, past + seq, dtype=np.int64).reshape(1, seq),
    }
    for i in range(BLOCKS):
        for kind in ("key", "value"):
            value = rng.standard_normal((1, 1, past, WIDTH)).astype(np.float32)
            feeds[f"past_key_values.{i}.{kind}"] = value
    return feeds


def padding() -> Padding:
    states = tuple(
        (f"past_key_values.{i}.{k}", f"present.{i}.{k}", 2)
        for i in range(BLOCKS)
        for k in ("key", "value")
    )
    return Padding("attention_mask", states)


# ---------------------------------------------------------------------- pure parts


def test_steps_group_by_every_shape_but_the_batch_axis() -> None:
    a, b = step(5, 1, 0), step(5, 2, 1)
    assert group_key(a) == group_key(b)
    assert group_key(a) == group_key(stack([a, b]))  # the batch axis is not part of it
    assert group_key(a) != group_key(step(6, 1, 0))  # another past length
    assert group_key(a) != group_key(step(5, 1, 0, seq=3))  # a draft round of 3
    as_int32 = {**a, "input_ids": a["input_ids"].astype(np.int32)}
    assert group_key(a) != group_key(as_int32)


def test_with_padding_past_lengths_group_but_step_lengths_do_not() -> None:
    spec = padding()
    assert group_key(step(5, 1, 0), spec) == group_key(step(9, 1, 0), spec)
    assert group_key(step(5, 1, 0), spec) != group_key(step(5, 1, 0, seq=2), spec)


def test_stack_and_split_are_inverse_and_split_checks_the_batch_axis() -> None:
    members = [step(4, t, t) for t in range(3)]
    stacked = stack(members)
    assert stacked["input_ids"].shape == (3, 1)
    parts = split(stacked, [1, 1, 1])
    for part, member in zip(parts, members, strict=True):
        assert all(np.array_equal(part[n], member[n]) for n in member)
    with pytest.raises(ModelError, match="expected 3 rows on axis 0"):
        split({"x": np.zeros((2, 4))}, [1, 1, 1])
    with pytest.raises(ModelError, match="expected 2 rows"):
        split({"scalar": np.float32(1.0) * np.ones(())}, [1, 1])


def test_members_that_are_one_arrays_rows_back_to_back_stack_as_those_rows() -> None:
    # An array of its own, as ONNX Runtime's outputs are (not a view of another's).
    cache = np.arange(4 * 2 * 8 * 64, dtype=np.float32).reshape(4, 2, 8, 64).copy()
    ids = np.arange(4, dtype=np.int64).reshape(4, 1).copy()
    assert cache[:1].nbytes >= IN_PLACE_BYTES > ids[:1].nbytes
    parts = split({"cache": cache, "ids": ids}, [1, 2, 1])
    for members, rows in ((parts, cache), (parts[1:], cache[1:])):
        stacked = stack(members)
        assert np.shares_memory(stacked["cache"], cache)  # no copy
        assert np.array_equal(stacked["cache"], rows)
    assert not np.shares_memory(stack(parts)["ids"], ids)  # too small to look for
    other = split({"cache": cache.copy(), "ids": ids}, [1, 3])[1]
    for members in ([parts[1], parts[0], parts[2]], [parts[0], parts[2]], [parts[0], other]):
        stacked = stack(members)  # out of order, a row missing, another array: a copy
        assert not np.shares_memory(stacked["cache"], cache)
        assert np.array_equal(stacked["cache"], np.concatenate([m["cache"] for m in members]))


def test_row_order_puts_the_rows_of_one_call_back_in_that_calls_order() -> None:
    cache = np.zeros((3, 2, 8, 64), np.float32)
    parts = split({"cache": cache, "ids": np.zeros((3, 1), np.int64)}, [1, 1, 1])
    shuffled = [parts[2], parts[0], parts[1]]
    order = row_order(shuffled)
    assert order == [1, 2, 0]
    assert np.shares_memory(stack([shuffled[i] for i in order])["cache"], cache)


def test_padding_fills_the_front_and_unpad_gives_each_member_its_own_back() -> None:
    spec = padding()
    short, long = step(3, 1, 0), step(7, 2, 1)
    (padded_short, padded_long), extras = pad([short, long], spec)
    assert extras == [4, 0]
    assert padded_long is long or padded_long == long
    cache = padded_short["past_key_values.0.key"]
    assert cache.shape == (1, 1, 7, WIDTH) and not cache[:, :, :4].any()
    assert np.array_equal(cache[:, :, 4:], short["past_key_values.0.key"])
    assert padded_short["attention_mask"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
    outputs = {"present.0.key": np.ones((1, 1, 8, WIDTH)), **padded_short}
    own = unpad(outputs, short, 4, spec)
    assert own["present.0.key"].shape == (1, 1, 4, WIDTH)
    assert np.array_equal(own["attention_mask"], short["attention_mask"])


# ---------------------------------------------------------------------- the batcher


def run_queued(
    batcher: StepBatcher,
    first: Mapping[str, np.ndarray],
    others: Sequence[tuple[Mapping[str, np.ndarray], float]],
    member_run: Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]],
    calls: list[int],
    owners: Sequence[str] = (),
) -> list[dict[str, np.ndarray] | BaseException]:
    """Run ``first``; while its call runs, the ``others`` (feeds, deadline) queue behind it,
    one after another in their order (the queue's order is what the tests check).

    Returns each step's outputs or error, ``first`` first; ``calls`` gets each call's rows.
    ``owners``: each step's owner, ``first``'s first (default: "").
    """
    results: list[dict[str, np.ndarray] | BaseException] = [ValueError("not run")] * (
        1 + len(others)
    )

    def submit(i: int, feeds: Mapping[str, np.ndarray], deadline: float) -> None:
        try:
            owner = owners[i] if owners else ""
            results[i] = batcher.run(feeds, member=f"s{i}", owner=owner, deadline_unix_s=deadline)
        except Exception as exc:
            results[i] = exc

    threads = [
        threading.Thread(target=submit, args=(i + 1, feeds, deadline))
        for i, (feeds, deadline) in enumerate(others)
    ]

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        calls.append(int(next(iter(feeds.values())).shape[0]))
        if len(calls) == 1:  # the first call: the others arrive while it runs, in order
            for queued, thread in enumerate(threads, start=1):
                thread.start()
                with batcher._cond:
                    assert batcher._cond.wait_for(lambda n=queued: len(batcher._queue) == n, 30)
        return member_run(feeds)

    batcher._run = run
    submit(0, first, 0.0)
    for thread in threads:
        thread.join(30)
    return results


def test_an_idle_batcher_runs_a_step_at_once_alone(runner: SegmentRunner) -> None:
    calls: list[int] = []

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        calls.append(1)
        return runner.run(feeds)

    batcher = StepBatcher(run, name="test", max_batch=8, delay_s=0.05)
    feeds = step(4, 3, 0)
    out = batcher.run(feeds, member="s")
    out = batcher.run(feeds, member="s")  # the one session active: no wait for company
    assert calls == [1, 1] and batcher.stats.batched == 0
    assert np.array_equal(out["logits"], runner.run(feeds)["logits"])


@pytest.mark.parametrize("own_thread", [True, False])
def test_with_a_thread_of_its_own_every_call_runs_there_once_threads_take_turns(
    runner: SegmentRunner, own_thread: bool
) -> None:
    """[Note: the step batcher]: a tier's requests come on its pool's threads in turn;
    with ``own_thread`` the calls run on one thread: the caller's while one thread has
    led every call, the batcher's own from the first call another thread leads. A
    failing call's error still reaches its step's caller."""
    threads: list[int] = []

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        threads.append(threading.get_ident())
        return runner.run(feeds)

    batcher = StepBatcher(run, name="the test", max_batch=8, own_thread=own_thread)
    feeds = step(4, 3, 0)
    callers: list[int] = []

    def caller() -> None:
        callers.append(threading.get_ident())
        out = batcher.run(feeds, member="s")
        assert np.array_equal(out["logits"], runner.run(feeds)["logits"])

    caller()
    caller()  # this thread leads every call so far: they run here
    assert threads == [threading.get_ident()] * 2
    for _ in range(3):  # one after the other, each from a thread of its own
        worker = threading.Thread(target=caller)
        worker.start()
        worker.join()
    caller()  # this thread again, no longer the only one to lead
    assert len(threads) == 6 and batcher.stats.calls == 6
    later = threads[2:]
    if own_thread:
        assert len(set(later)) == 1 and not set(later) & set(callers)
    else:
        assert later == callers[2:]
    with pytest.raises((InputError, ModelError)):
        batcher.run(step(4, VOCAB + 50, 9), member="bad")  # past the vocabulary


def test_queued_steps_of_one_group_share_one_call_and_match_running_alone(
    runner: SegmentRunner,
) -> None:
    batcher = StepBatcher(runner.run, name="test", max_batch=8)
    first = step(6, 1, 0)
    others = [(step(6, t, t), 0.0) for t in range(2, 6)]
    calls: list[int] = []
    results = run_queued(batcher, first, others, runner.run, calls)
    assert calls == [1, 4]  # the first alone (the tier was idle), then the four together
    for result, feeds in zip(results, [first, *[f for f, _ in others]], strict=True):
        assert isinstance(result, dict)
        alone = runner.run(feeds)
        for name in runner.output_names:  # bit for bit, logits and new caches alike
            assert np.array_equal(result[name], alone[name]), name
    assert batcher.stats.largest == 4 and batcher.stats.batched == 4
    assert set(batcher.stats.seconds) == {1, 4} and min(batcher.stats.seconds.values()) > 0


def test_steps_whose_caches_are_an_earlier_calls_rows_run_in_place_as_if_alone(
    runner: SegmentRunner,
) -> None:
    batcher = StepBatcher(runner.run, name="test", max_batch=8)
    firsts = [step(130, t, t) for t in range(1, 4)]  # caches of 130 x 8 floats: looked for
    outs = batcher.run_all([Pending(batcher, f, member=t) for t, f in enumerate(firsts)])
    nexts = []
    for first, out in zip(firsts, outs, strict=True):  # each session's next step, its
        assert isinstance(out, dict)  # caches its rows of the call's new ones, as a tier keeps
        feeds = step(131, 7, 0)
        for name in first:
            if name.startswith("past_key_values."):
                feeds[name] = out[name.replace("past_key_values", "present")]
        nexts.append(feeds)
    given: list[Mapping[str, np.ndarray]] = []

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        given.append(feeds)
        return runner.run(feeds)

    batcher._run = run
    shuffled = [nexts[2], nexts[0], nexts[1]]
    results = batcher.run_all([Pending(batcher, f, member=i) for i, f in enumerate(shuffled)])
    present = outs[0]["present.0.key"].base  # the first call's whole array
    assert np.shares_memory(given[0]["past_key_values.0.key"], present)
    for result, feeds in zip(results, shuffled, strict=True):
        assert isinstance(result, dict)
        alone = runner.run(feeds)
        for name in runner.output_names:
            assert np.array_equal(result[name], alone[name]), name


def test_other_groups_wait_for_the_next_call_and_the_oldest_goes_first(
    runner: SegmentRunner,
) -> None:
    batcher = StepBatcher(runner.run, name="test", max_batch=2)
    others = [
        (step(5, 1, 1), 0.0),  # oldest queued: its group goes next
        (step(9, 1, 2), 0.0),  # another past length: not with it
        (step(5, 2, 3), 0.0),
        (step(5, 3, 4), 0.0),  # over --max-batch 2: the call after
    ]
    calls: list[int] = []
    results = run_queued(batcher, step(5, 4, 0), others, runner.run, calls)
    assert calls == [1, 2, 1, 1]
    assert all(isinstance(r, dict) for r in results)


def test_a_full_batch_gives_each_owner_a_place_before_any_owner_a_second(
    runner: SegmentRunner,
) -> None:
    batcher = StepBatcher(runner.run, name="test", max_batch=2)
    others = [(step(5, t, t), 0.0) for t in range(1, 5)]
    rows: list[list[int]] = []

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows.append(sorted(feeds["input_ids"][:, 0].tolist()))  # a call's rows, in any order
        return runner.run(feeds)

    calls: list[int] = []
    # Queued: a's tokens 1, 2, 3, then b's 4; a batch of two takes a's oldest and b's.
    results = run_queued(batcher, step(5, 9, 0), others, run, calls, ["a", "a", "a", "a", "b"])
    assert rows == [[9], [1, 4], [2, 3]]
    assert all(isinstance(r, dict) for r in results)


def test_queued_steps_lend_their_worker_so_a_batch_outgrows_the_workers(
    runner: SegmentRunner,
) -> None:
    """One worker slot ([Note: a worker lent while a step queues]): the step running lends
    it, and each of the others takes it, queues and lends it on, so all queue at once."""
    slots = WorkerSlots(1)
    batcher = StepBatcher(runner.run, name="test", max_batch=8)
    first = step(6, 1, 0)
    others = [step(6, t, t) for t in range(2, 6)]
    calls: list[int] = []
    results: list[object] = [None] * len(others)

    def queue(i: int) -> None:
        with slots:
            results[i] = batcher.run(others[i], member=f"s{i}")

    threads = [threading.Thread(target=queue, args=(i,)) for i in range(len(others))]

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        calls.append(int(feeds["input_ids"].shape[0]))
        if len(calls) == 1:
            for thread in threads:
                thread.start()
            with batcher._cond:  # every other step queues while this call holds the slot
                assert batcher._cond.wait_for(lambda: len(batcher._queue) == len(others), 30)
        return runner.run(feeds)

    batcher._run = run
    with slots:
        batcher.run(first, member="first")
    for thread in threads:
        thread.join(30)
    assert calls == [1, 4]
    assert all(isinstance(r, dict) for r in results)


def test_a_member_that_fails_fails_alone_with_its_own_error(runner: SegmentRunner) -> None:
    batcher = StepBatcher(runner.run, name="test", max_batch=8)
    good = [step(4, t, t) for t in (1, 2)]
    bad = step(4, VOCAB + 50, 9)  # a token past the vocabulary: the embedding fails
    expired = step(4, 3, 3)
    others = [(good[1], 0.0), (bad, 0.0), (expired, 1.0)]  # 1.0: long past
    calls: list[int] = []
    results = run_queued(batcher, good[0], others, runner.run, calls)
    assert isinstance(results[2], InputError | ModelError)
    assert isinstance(results[3], DeadlineError)
    for result, feeds in zip(results[:2], good, strict=True):
        assert isinstance(result, dict)
        assert np.array_equal(result["logits"], runner.run(feeds)["logits"])
    assert calls == [1, 2, 1, 1]  # the batch of two failed, then each alone


def test_a_tier_runner_batches_only_what_it_can(tmp_path: Path) -> None:
    from tierflow.partitioner.decoder_graph import load_decoder, split_decoder
    from tierflow.partitioner.decoder_points import DecoderSettings
    from tierflow.partitioner.split import save_split_plan
    from tierflow.plan import load_plan
    from tierflow.runtime.segment_runner import TierRunner

    model = tiny_decoder(tmp_path / "d.onnx", blocks=2, vocab=VOCAB)
    graph = load_decoder(model, DecoderSettings(context=32, max_tokens=4, prompt_tokens=2))
    last = len(graph.prefill.cuts) - 1
    save_split_plan(
        graph.prefill,
        split_decoder(graph, (0, 0)),
        tmp_path / "plan",
        cuts=(0, 0),
        decoder=graph.decoder,
    )
    plan = load_plan(tmp_path / "plan")
    assert last > 0
    cloud = TierRunner(plan, tmp_path / "plan", "cloud", RuntimeOptions())
    assert cloud.batcher is not None and cloud.batcher.padding is None
    padded = TierRunner(plan, tmp_path / "plan", "cloud", RuntimeOptions(batch_padding=True))
    assert padded.batcher is not None and padded.batcher.padding is not None
    assert TierRunner(plan, tmp_path / "plan", "cloud", RuntimeOptions(max_batch=1)).batcher is None
    # A tier with none of the plan's segments gathers steps to send on together; its
    # call runs nothing: a step's tensors go on as they came.
    edge = TierRunner(plan, tmp_path / "plan", "edge", RuntimeOptions())
    assert not edge.segments and edge.batcher is not None
    ids = np.array([[3]], dtype=np.int64)
    sent = edge.batcher.run({name: ids for name in edge.needs})
    assert set(sent) == set(edge.needs) and all(v is ids for v in sent.values())


# ---------------------------------------------------------------------- --batch-delay


class Clock:
    """A clock that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Delayed:
    """A batcher with a long --batch-delay on a clock of the test's: each call's rows are
    recorded, and a step's thread can be watched while it waits for company. Unless
    ``first_waits``, a session's first step runs at once (the tests of later steps seed
    each session's history with one)."""

    def __init__(
        self, runner: SegmentRunner, max_batch: int = 8, first_waits: bool = False
    ) -> None:
        self.runner = runner
        self.clock = Clock()
        self.calls: list[int] = []
        self.hook: Callable[[int], None] = lambda rows: None
        #: 60 s of the test's clock: a wait ends by company, or by the test moving the clock.
        self.batcher = StepBatcher(
            self._run,
            name="test",
            max_batch=max_batch,
            delay_s=60.0,
            clock=self.clock,
            first_waits=first_waits,
        )

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = int(feeds["input_ids"].shape[0])
        self.calls.append(rows)
        self.hook(rows)
        return self.runner.run(feeds)

    def at(self, when: float, *steps: tuple[str, Mapping[str, np.ndarray]]) -> None:
        """Run ``steps`` (member, feeds) one after the other at ``when``, each to its end."""
        self.clock.now = when
        for member, feeds in steps:
            self.batcher.run(feeds, member=member)

    def start(self, member: str, feeds: Mapping[str, np.ndarray]) -> threading.Thread:
        thread = threading.Thread(target=self.batcher.run, args=(feeds,), kwargs={"member": member})
        thread.start()
        return thread

    def queued(self, count: int, thread: threading.Thread) -> bool:
        """Whether ``count`` steps queue (waiting for company) before ``thread`` ends."""
        with self.batcher._cond:
            self.batcher._cond.wait_for(
                lambda: len(self.batcher._queue) >= count or not thread.is_alive(), 30
            )
            return len(self.batcher._queue) >= count

    def wake(self) -> None:
        """Wake a leader waiting for company, to read the clock again."""
        with self.batcher._cond:
            self.batcher._cond.notify_all()

    def finish(self, *threads: threading.Thread) -> bool:
        """Whether ``threads`` end by themselves (within 30 s); if not, the delay is let
        pass on the clock so that they end all the same."""
        for thread in threads:
            thread.join(30)
        ended = not any(thread.is_alive() for thread in threads)
        if not ended:
            self.clock.now += 3600
            self.wake()
            for thread in threads:
                thread.join(30)
        return ended


def test_with_a_delay_a_step_at_an_idle_tier_waits_for_its_sessions_company(
    runner: SegmentRunner,
) -> None:
    """Lockstep sessions do not fall into turns ([Note: the step batcher]): the first step
    of a round finds the tier idle and waits for the other session's, then both run as
    one call, bit for bit as alone."""
    tier = Delayed(runner)
    tier.at(0.0, ("a", step(4, 1, 0)), ("b", step(4, 2, 1)))
    assert tier.calls == [1, 1]  # b's first step: a's step is not its company
    a, b = step(5, 3, 2), step(5, 4, 3)
    tier.clock.now = 0.1
    first = tier.start("a", a)
    assert tier.queued(1, first), "a's step ran alone instead of waiting for b's"
    results = {}
    second = threading.Thread(target=lambda: results.update(b=tier.batcher.run(b, member="b")))
    second.start()
    assert tier.finish(first, second)
    assert tier.calls == [1, 1, 2]
    alone = runner.run(b)
    for name in runner.output_names:
        assert np.array_equal(results["b"][name], alone[name]), name


def test_with_a_delay_sessions_that_start_together_start_as_one_batch(
    runner: SegmentRunner,
) -> None:
    """A session's first step waits for company too ([Note: the step batcher]): the first
    steps of a, b and c, coming one after another to an idle tier, run as one call once
    their group is full; a lone session's first step waits at most the delay; the first
    steps of a batched request are their own company and do not wait."""
    tier = Delayed(runner, max_batch=3, first_waits=True)
    tier.clock.now = 5.0
    first = tier.start("a", step(4, 1, 0))
    assert tier.queued(1, first), "a's first step ran alone instead of waiting for company"
    second = tier.start("b", step(4, 2, 1))
    assert tier.queued(2, second)
    third = tier.start("c", step(4, 3, 2))  # the group is full: all three go
    assert tier.finish(first, second, third), "a full group still waited"
    assert tier.calls == [3]

    lone = tier.start("d", step(7, 4, 3))
    assert tier.queued(1, lone)
    tier.clock.now += 60.0  # the delay passed and no one came
    tier.wake()
    lone.join(30)
    assert not lone.is_alive() and tier.calls == [3, 1]

    pendings = [
        Pending(tier.batcher, step(9, 5 + seat, 4 + seat), member=f"e{seat}") for seat in range(2)
    ]
    together = threading.Thread(target=tier.batcher.run_all, args=(pendings,))
    together.start()
    assert tier.finish(together), "a batched request's first steps waited for company"
    assert tier.calls == [3, 1, 2]


def test_a_lone_sessions_later_steps_never_wait_however_far_apart(runner: SegmentRunner) -> None:
    """Only a session's first step (or its first after ``ACTIVE_S`` without one) waits as
    a newcomer: a lone session whose step comes later than two of its rounds (here 0.49 s
    after a round of 0.01 s) expects no company and runs at once."""
    tier = Delayed(runner, first_waits=True)
    first = tier.start("a", step(4, 1, 0))
    assert tier.queued(1, first)
    tier.clock.now = 60.0  # its first step waited the delay out: no one came
    tier.wake()
    first.join(30)
    tier.at(60.01, ("a", step(5, 2, 1)))
    tier.clock.now = 60.5
    later = tier.start("a", step(6, 3, 2))
    assert tier.finish(later), "a lone session's later step waited as if it were new"
    assert tier.calls == [1, 1, 1]


def test_with_a_delay_a_step_waits_for_company_at_most_the_delay(runner: SegmentRunner) -> None:
    tier = Delayed(runner)
    tier.at(0.0, ("a", step(4, 1, 0)), ("b", step(4, 2, 1)))
    tier.clock.now = 0.1
    first = tier.start("a", step(5, 3, 2))
    assert tier.queued(1, first)
    tier.clock.now = 0.1 + 60.0  # the delay passed and b's step did not come
    tier.wake()
    first.join(30)
    assert not first.is_alive() and tier.calls == [1, 1, 1]


def test_a_session_that_stopped_is_not_waited_for_after_two_of_its_rounds(
    runner: SegmentRunner,
) -> None:
    """a and b step together every 0.1 s; b stops: a waits for it no longer once b's last
    step is ``ROUNDS`` (2) rounds old, not ``ACTIVE_S`` (2 s)."""
    tier = Delayed(runner)
    tier.at(0.0, ("a", step(4, 1, 0)), ("b", step(4, 2, 1)))
    tier.clock.now = 0.1
    first = tier.start("a", step(5, 3, 2))
    assert tier.queued(1, first)
    second = tier.start("b", step(5, 4, 3))
    assert tier.finish(first, second) and tier.calls == [1, 1, 2]
    tier.clock.now = 0.1 + 0.25  # b's last step was 0.25 s ago, its round 0.1 s
    alone = tier.start("a", step(6, 5, 4))
    assert tier.finish(alone), "a waited for b, which stopped two rounds ago"
    assert tier.calls == [1, 1, 2, 1]


def test_steps_of_other_lengths_are_not_company(runner: SegmentRunner) -> None:
    """b is at another past length (its steps never share a call with a's in the exact
    default): a's step does not wait for it."""
    tier = Delayed(runner)
    tier.at(0.0, ("a", step(4, 1, 0)), ("b", step(9, 2, 1)))
    tier.clock.now = 0.1
    first = tier.start("a", step(5, 3, 2))
    assert tier.finish(first), "a waited for b, a step of another length"
    assert tier.calls == [1, 1, 1]


def test_steps_queued_behind_a_batch_do_not_wait_for_its_sessions(runner: SegmentRunner) -> None:
    """With --max-batch 2, a and b run as a batch and c's step queues behind it: c's
    company (a, b) just ran a round ahead of it, so c runs next, at once."""
    tier = Delayed(runner, max_batch=2)
    tier.at(0.0, ("a", step(4, 1, 0)), ("b", step(4, 2, 1)), ("c", step(4, 3, 2)))
    threads: list[threading.Thread] = []

    def queue_c(rows: int) -> None:
        if rows == 2 and not threads:  # a and b's batch: c arrives while it runs
            threads.append(tier.start("c", step(5, 6, 5)))
            assert tier.queued(1, threads[0])

    tier.hook = queue_c
    tier.clock.now = 0.1
    first = tier.start("a", step(5, 4, 3))
    assert tier.queued(1, first)
    second = tier.start("b", step(5, 5, 4))  # a's group is full: a and b go
    assert tier.finish(first, second)
    assert tier.finish(*threads), "c waited for a and b, a round ahead of it"
    assert tier.calls == [1, 1, 1, 2, 1]


def test_without_a_delay_nothing_waits_and_nothing_is_tracked(runner: SegmentRunner) -> None:
    batcher = StepBatcher(runner.run, name="test", max_batch=8)
    batcher.run(step(4, 1, 0), member="a")
    batcher.run(step(4, 2, 1), member="b")
    batcher.run(step(5, 3, 2), member="a")  # b is active: with no delay, a runs at once
    assert batcher.stats.sizes == {1: 3} and not batcher._seen
