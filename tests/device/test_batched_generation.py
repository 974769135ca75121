"""Concurrent generation through tiers that batch decode steps ([Note: the step batcher] in
tierflow/runtime/batching.py): every session's greedy output is the unsplit model's own,
batched or not, with drafts and across a lost state; batches grow past ``--workers``; and
a session whose step fails (a bad tensor, a lost state, a deadline) fails alone.

Whether steps meet in a batch depends on timing; where a test needs a batch it makes one
without a race: the sessions wait for each other (a barrier), then the first step to
reach a tier's batcher holds its call until the others have queued behind it
(:func:`gate`), so the next call takes them all.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tierflow.device.client import DeviceClient
from tierflow.device.generation import Generator, TierDecoder
from tierflow.edge.forwarding import Forwarding
from tierflow.errors import InputError, RemoteError, StateError, UsageError, is_missing
from tierflow.greedy import reference_generate
from tierflow.options import RuntimeOptions
from tierflow.partitioner.decoder_graph import load_decoder, split_decoder
from tierflow.partitioner.decoder_points import DecoderSettings
from tierflow.partitioner.split import save_split_plan
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.batching import StepBatcher, stack
from tierflow.runtime.server import TierServer
from tierflow.transport.wire import decode_tensors, encode_tensors, grpc_options
from tierflow.zoo.tiny_stateful import tiny_decoder

pytestmark = pytest.mark.integration

CONTEXT = 64
VOCAB = 32
TOKENS = 12
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [2, 7, 1]]


def decoder_plan(model: Path, plan_dir: Path, where: str) -> Path:
    """The decoder over three tiers (``split``) or in the cloud alone (``cloud``)."""
    graph = load_decoder(model, DecoderSettings(context=CONTEXT, max_tokens=16, prompt_tokens=5))
    last = len(graph.prefill.cuts) - 1
    cuts = (last // 3, 2 * last // 3) if where == "split" else (0, 0)
    save_split_plan(
        graph.prefill, split_decoder(graph, cuts), plan_dir, cuts=cuts, decoder=graph.decoder
    )
    return plan_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batched")
    model = tiny_decoder(root / "model.onnx", blocks=6, vocab=VOCAB, seed=1)
    return {
        "model": model,
        "same": tiny_decoder(root / "same.onnx", blocks=6, vocab=VOCAB, seed=1),
        "split": decoder_plan(model, root / "split", "split"),
        "cloud": decoder_plan(model, root / "cloud", "cloud"),
    }


@contextlib.contextmanager
def serving(plan: Path, options: RuntimeOptions) -> Iterator[tuple[Path, TierServer, TierServer]]:
    cloud = TierServer.from_plan("cloud", plan, options=options)
    cloud.start()
    edge = TierServer.from_plan("edge", plan, forwarder=Forwarding(cloud.address), options=options)
    edge.start()
    try:
        yield plan, cloud, edge
    finally:
        edge.stop(0)
        cloud.stop(0)


@pytest.fixture()
def tiers(request: Any, models: dict[str, Path]) -> Iterator[tuple[Path, TierServer, TierServer]]:
    # A tiny model's steps take well under a millisecond: --batch-delay lets the sessions'
    # steps meet on every tier, where a real model's long steps make them queue.
    options = RuntimeOptions(workers=8, max_batch=8, batch_delay_s=0.02)
    with serving(models[request.param], options) as served:
        yield served


def batcher_of(server: TierServer) -> StepBatcher:
    pipeline = server.tier.pipeline
    assert pipeline is not None
    batcher = pipeline.runner(0).batcher
    assert batcher is not None
    return batcher


def cloud_batches(cloud: TierServer) -> int:
    """Steps the cloud ran in batches of more than one."""
    return batcher_of(cloud).stats.batched


def gate(
    batcher: StepBatcher, steps: int, calls: list[tuple[int, ...]] | None = None
) -> Callable[[], None]:
    """Once armed (call what it returns), the batcher's next call waits until the rest of
    ``steps`` steps have queued behind it (at most 20 s), so the call after takes them
    together. The call held may be several steps already (a batch that came in one
    message: [Note: a batch in one message]). ``calls`` gets each call's
    ``position_ids`` shape ([rows, step length])."""
    run = batcher._run
    armed = threading.Event()
    done = threading.Event()

    def gated(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if calls is not None:
            calls.append(tuple(feeds["position_ids"].shape))
        if armed.is_set() and not done.is_set():
            done.set()
            held = int(feeds["position_ids"].shape[0])
            ends = time.monotonic() + 20
            while held + batcher.queued() < steps and time.monotonic() < ends:
                time.sleep(0.005)
        return run(feeds)

    batcher._run = gated
    return armed.set


def lockstep(count: int, step: Callable[[int], object]) -> dict[int, object]:
    """``count`` sessions: each runs ``step(i)`` (its whole generation) on its own thread;
    what each returned, or raised."""
    outputs: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            outputs[i] = step(i)
        except Exception as exc:
            outputs[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return outputs


def four_tokens(
    client: DeviceClient,
    prompt: Sequence[int],
    prefilled: threading.Barrier,
    results: list[Any] | None = None,
) -> list[int]:
    """One session's four greedy tokens, a request each: the prefill, then (once every
    session has prefilled, ``prefilled``: all at the same position, one group) three
    steps. ``results`` gets the steps' results."""
    decoder = TierDecoder(client)
    made = [int(decoder.choose(prompt, 0, keep=1)[-1])]
    prefilled.wait(60)
    for _ in range(3):
        position = len(prompt) + len(made) - 1
        made.append(int(decoder.choose([made[-1]], position, keep=1)[-1]))
    if results is not None:
        results.extend(decoder.results[1:])
    return made


@pytest.mark.parametrize("tiers", ["split", "cloud"], indirect=True)
def test_concurrent_sessions_are_token_identical_to_running_alone(
    models: dict[str, Path], tiers: tuple[Path, TierServer, TierServer]
) -> None:
    plan, cloud, edge = tiers
    with DeviceClient(plan, edge.address) as client:
        outputs = lockstep(
            len(PROMPTS), lambda i: list(Generator(client).generate(PROMPTS[i], TOKENS).tokens)
        )
    for i, prompt in enumerate(PROMPTS):
        expected = reference_generate(models["model"], prompt, TOKENS, context=CONTEXT).tokens
        assert outputs[i] == list(expected), f"session {i}"
    # Four sessions in lockstep (the fifth's prompt is shorter, a group of its own) share
    # calls.
    assert cloud_batches(cloud) > 0


@pytest.mark.parametrize("tiers", ["cloud"], indirect=True)
def test_a_session_whose_step_fails_fails_alone(
    models: dict[str, Path], tiers: tuple[Path, TierServer, TierServer]
) -> None:
    plan, _, edge = tiers
    outputs: dict[int, list[int] | BaseException] = {}
    errors: list[BaseException | None] = []
    with DeviceClient(plan, edge.address) as client:
        decoder = client.plan.decoder
        assert decoder is not None

        def generate(i: int) -> None:
            try:
                outputs[i] = list(Generator(client).generate(PROMPTS[i], TOKENS).tokens)
            except Exception as exc:
                outputs[i] = exc

        def bad_session(i: int) -> None:
            """The prompt, then a token past the vocabulary where the others take their
            first decode step: the same shapes as theirs, so it can share their call."""
            session = f"bad-{i}"
            prompt = decoder.step_feeds(PROMPTS[i], 0)
            client.submit(prompt, session=session, position=0).result().unwrap()
            bad = decoder.step_feeds([VOCAB + 7], len(PROMPTS[i]))
            result = client.submit(bad, session=session, position=len(PROMPTS[i])).result()
            errors.append(result.error)

        threads = [threading.Thread(target=generate, args=(i,)) for i in range(3)]
        threads += [threading.Thread(target=bad_session, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert len(errors) == 3
    for error in errors:
        assert isinstance(error, RemoteError) and error.code == "INVALID_INPUT", error
    for i in range(3):
        expected = reference_generate(models["model"], PROMPTS[i], TOKENS, context=CONTEXT).tokens
        assert outputs[i] == list(expected), f"session {i}"


def test_batches_outgrow_the_workers(models: dict[str, Path]) -> None:
    """Eight sessions through a cloud with two workers (the default on a 2-core machine):
    a batch of all eight forms ([Note: a worker lent while a step queues]); before, a
    batch was capped by the workers."""
    prompt = PROMPTS[0]
    options = RuntimeOptions(workers=2, max_batch=8)
    with serving(models["cloud"], options) as (plan, cloud, edge):
        arm = gate(batcher_of(cloud), 8)
        prefilled = threading.Barrier(8, action=arm)
        with DeviceClient(plan, edge.address) as client:
            outputs = lockstep(8, lambda i: four_tokens(client, prompt, prefilled))
        # The tier's batch-size figures (its metrics' tierflow_batch_calls_total).
        sizes = {size for stats in cloud.tier.batch_stats() for size in stats.sizes}
    expected = reference_generate(models["model"], prompt, 4, context=CONTEXT).tokens
    assert all(outputs[i] == list(expected) for i in range(8)), outputs
    assert max(sizes) > 2, sizes


def test_draft_rounds_batch_and_stay_token_identical(models: dict[str, Path]) -> None:
    """A draft round is a step of several positions: four sessions' rounds of 1 + 3
    positions share the cloud's calls, and every session's output is the model's own."""
    options = RuntimeOptions(workers=2, max_batch=8)
    calls: list[tuple[int, ...]] = []
    with serving(models["split"], options) as (plan, cloud, edge):
        arm = gate(batcher_of(cloud), 4, calls)
        prefilled = threading.Barrier(4, action=arm)

        def wait_at_first(token: int, draft_only: bool) -> None:
            if not prefilled.broken and prefilled.n_waiting < 4:
                with contextlib.suppress(threading.BrokenBarrierError):
                    prefilled.wait(60)
                prefilled.abort()  # once: later tokens go straight on

        with DeviceClient(plan, edge.address) as client:

            def session(i: int) -> list[int]:
                generator = Generator(client, draft=models["same"], draft_tokens=3)
                report = generator.generate(PROMPTS[0], TOKENS, on_token=wait_at_first)
                assert report.drafted > 0 and report.accepted == report.drafted
                return report.tokens

            outputs = lockstep(4, session)
    expected = reference_generate(models["model"], PROMPTS[0], TOKENS, context=CONTEXT).tokens
    assert all(outputs[i] == list(expected) for i in range(4)), outputs
    # Draft rounds of 4 positions shared a call (the held call's, or the next).
    assert any(rows >= 2 and length == 4 for rows, length in calls), calls


def test_lost_states_are_replayed_in_batches_and_the_output_does_not_change(
    models: dict[str, Path],
) -> None:
    """Two of four sessions lose their cloud state mid-generation, where the four steps
    share a call at the edge and go on to the cloud together: the two fail there alone
    (STATE_LOST, the others are answered) and replay, and every session's output is the
    model's own ([Note: replaying a session]). The edge is held, not the cloud: a batch
    in one message is answered once all its members are, so a cloud held for the replays
    would hold the answers that start them."""
    options = RuntimeOptions(workers=2, max_batch=8)
    with serving(models["split"], options) as (plan, cloud, edge):
        batcher = batcher_of(edge)
        arm = gate(batcher, 4)
        generators: list[Generator] = []
        batched: list[int] = []

        def drop_two() -> None:
            pipeline = cloud.tier.pipeline
            assert pipeline is not None
            for generator in generators[:2]:
                pipeline.states.drop(generator.target.session)
            batched.append(batcher.stats.batched)
            arm()

        midway = threading.Barrier(4, action=drop_two)

        with DeviceClient(plan, edge.address) as client:
            generators.extend(Generator(client) for _ in range(4))

            def session(i: int) -> tuple[list[int], int]:
                generator = generators[i]

                def wait_midway(token: int, draft_only: bool) -> None:
                    if len(generator.target.fed) == len(PROMPTS[0]) + 4:
                        midway.wait(60)

                report = generator.generate(PROMPTS[0], TOKENS, on_token=wait_midway)
                return report.tokens, report.replays

            outputs = lockstep(4, session)
        after = batcher.stats.batched
    expected = reference_generate(models["model"], PROMPTS[0], TOKENS, context=CONTEXT).tokens
    assert [outputs[i] for i in range(4)] == [
        (list(expected), 1),
        (list(expected), 1),
        (list(expected), 0),
        (list(expected), 0),
    ]
    assert after >= batched[0] + 3  # the steps after the held one shared the edge's call


def test_a_member_fails_alone_with_its_own_error(models: dict[str, Path]) -> None:
    """Six sessions step at the same position while the cloud's batcher is held: one
    with a token past the vocabulary (INVALID_INPUT), one whose state the cloud lost
    (STATE_LOST), one whose deadline passes while it queues (DEADLINE_EXCEEDED); each
    fails alone, and the three others are answered as if alone."""
    options = RuntimeOptions(workers=2, max_batch=8)
    prompt = PROMPTS[0]
    with serving(models["cloud"], options) as (plan, cloud, edge):
        batcher = batcher_of(cloud)
        run = batcher._run
        held, release = threading.Event(), threading.Event()
        armed = threading.Event()

        def gated(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            if armed.is_set() and not held.is_set():
                held.set()
                assert release.wait(30)
            return run(feeds)

        batcher._run = gated
        with (
            DeviceClient(plan, edge.address) as client,
            DeviceClient(plan, edge.address, deadline_s=2.0) as hurried,
        ):
            decoder = client.plan.decoder
            assert decoder is not None
            who = ["good-0", "good-1", "good-2", "bad", "lost", "late"]
            firsts = {}
            for name in who:
                via = hurried if name == "late" else client
                feeds = decoder.step_feeds(prompt, 0)
                answer = via.submit(feeds, session=name, position=0, keep_last=1, choices_only=True)
                firsts[name] = int(answer.result().unwrap().outputs["logits"].reshape(-1)[-1])
            pipeline = cloud.tier.pipeline
            assert pipeline is not None
            pipeline.states.drop("lost")
            position = len(prompt)

            def step(name: str) -> Any:
                via = hurried if name == "late" else client
                token = VOCAB + 7 if name == "bad" else firsts[name]
                feeds = decoder.step_feeds([token], position)
                return via.submit(feeds, session=name, position=position, choices_only=True)

            armed.set()
            first = step("good-0")
            assert held.wait(30)  # good-0's call holds the batcher; the others queue
            tickets = {name: step(name) for name in who[1:]}
            ends = time.monotonic() + 30
            while batcher.queued() < 4 and time.monotonic() < ends:  # lost: refused before
                time.sleep(0.005)
            time.sleep(2.5)  # past late's deadline (2 s), in the queue
            release.set()
            results = {"good-0": first.result(), **{n: t.result() for n, t in tickets.items()}}
    expected = reference_generate(models["model"], prompt, 2, context=CONTEXT).tokens
    for name in who[:3]:
        assert results[name].error is None, results[name].error
        assert int(results[name].outputs["logits"].reshape(-1)[-1]) == expected[1]
    codes = {}
    for name in ("bad", "lost", "late"):
        error = results[name].error
        codes[name] = error.code if isinstance(error, RemoteError) else type(error).__name__
    assert codes == {
        "bad": "INVALID_INPUT",
        "lost": "STATE_LOST",
        "late": codes["late"] if codes["late"] == "DeadlineError" else "DEADLINE_EXCEEDED",
    }, codes
    assert batcher.stats.largest >= 3  # the good ones (and the bad) shared a call


@pytest.mark.parametrize("stacked", [False, True])
def test_a_member_whose_session_is_busy_waits_for_it_then_runs_alone(
    models: dict[str, Path], stacked: bool
) -> None:
    """A batched request arrives while one member's session has a request still running
    at the tier: the other member runs at once, that one waits for its session's request
    ([Note: a stream's requests run at once]) and then runs alone; the request's one reply
    carries both answers, each the model's own. The same when the members' tensors come
    stacked ([Note: a batch's tensors stacked]): the one that runs alone takes its rows."""
    prompt = PROMPTS[0]
    with serving(models["cloud"], RuntimeOptions(workers=2, max_batch=8)) as (_, cloud, _edge):
        tier = cloud.tier
        decoder = tier.plan.decoder
        assert decoder is not None

        def batch(steps: list[tuple[str, list[int], int]]) -> tier_pb2.Request:
            request = tier_pb2.Request(id="batch", plan_id=tier.plan_id)
            feeds = [decoder.step_feeds(tokens, position) for _, tokens, position in steps]
            for (session, _, position), step in zip(steps, feeds, strict=True):
                request.members.add(
                    id=session,
                    plan_id=tier.plan_id,
                    session=session,
                    position=position,
                    tensors=[] if stacked else encode_tensors(step, "raw"),
                    keep_last=1,
                    choices_only=True,
                )
            if stacked:
                request.tensors.extend(encode_tensors(stack(feeds), "raw"))
            return request

        def choices(reply: tier_pb2.Reply) -> list[int]:
            assert [r.id for r in reply.members] == ["s0", "s1"]
            for member in reply.members:
                assert not member.HasField("error"), member.error
            return [
                int(decode_tensors(list(m.outputs))["logits"].reshape(-1)[-1])
                for m in reply.members
            ]

        replies: list[tier_pb2.Reply] = []
        prefill = batch([("s0", list(prompt), 0), ("s1", list(prompt), 0)])
        tier.run_members(prefill, time.perf_counter(), replies.append, "me")
        first = choices(replies.pop())

        ran: list[str] = []
        key = ("me", "", "s1")
        assert tier.order.enter(key, lambda: ran.append("earlier"))  # s1's request runs
        position = len(prompt)
        steps = batch([("s0", [first[0]], position), ("s1", [first[1]], position)])
        tier.run_members(steps, time.perf_counter(), replies.append, "me")
        assert replies == [], "s1's step ran before its session's request ended"
        tier.order.drain(key, lambda: ran.append("earlier"))  # it ends; s1's step runs
        second = choices(replies.pop())
    expected = reference_generate(models["model"], prompt, 2, context=CONTEXT).tokens
    assert ran == ["earlier"]
    assert first == [expected[0]] * 2 and second == [expected[1]] * 2


def test_stacked_rows_that_do_not_fit_refuse_the_whole_message_with_one_typed_error(
    models: dict[str, Path],
) -> None:
    """Every member's rows are slices of the same stacked tensors, so the tier checks them
    once for all ([Note: a batch's tensors stacked]): token ids of the wrong dtype refuse
    the message whole, with one INVALID_INPUT that names what was expected, before
    anything runs; the next batch is answered."""
    prompt = list(PROMPTS[0])
    with serving(models["cloud"], RuntimeOptions(workers=2, max_batch=8)) as (_, cloud, _edge):
        tier = cloud.tier
        decoder = tier.plan.decoder
        assert decoder is not None

        def batch(dtype: type) -> tier_pb2.Request:
            request = tier_pb2.Request(id="batch", plan_id=tier.plan_id)
            for session in ("s0", "s1"):
                request.members.add(id=session, plan_id=tier.plan_id, session=session, keep_last=1)
            feeds = stack([decoder.step_feeds(prompt, 0)] * 2)
            feeds[decoder.tokens] = feeds[decoder.tokens].astype(dtype)
            request.tensors.extend(encode_tensors(feeds, "raw"))
            return request

        later: list[tier_pb2.Reply] = []
        refused = tier.handle(batch(np.int32), time.perf_counter(), later.append, "me")
        assert refused is not None and not later
        assert tier_pb2.ErrorCode.Name(refused.error.code) == "INVALID_INPUT"
        assert decoder.tokens in refused.error.message and "int64" in refused.error.message
        assert batcher_of(cloud).stats.calls == 0  # nothing ran
        assert tier.handle(batch(np.int64), time.perf_counter(), later.append, "me") is None
    assert [not m.HasField("error") for m in later[0].members] == [True, True]


def test_a_batch_in_one_message_runs_as_one_call_and_is_answered_in_one_reply(
    models: dict[str, Path],
) -> None:
    """A request whose members are five sessions' steps ([Note: a batch in one message]):
    the cloud runs them as one call and answers them in one reply, in order; then their
    next steps, of which one has a token past the vocabulary, one a lost state and one a
    deadline passed: those fail alone, each with its own code, the others are answered."""
    plan = models["cloud"]
    prompt = PROMPTS[0]
    with serving(plan, RuntimeOptions(workers=2, max_batch=8)) as (_, cloud, _edge):
        batcher = batcher_of(cloud)
        decoder = cloud.tier.plan.decoder
        assert decoder is not None
        plan_id = cloud.tier.plan_id

        def step(session: str, tokens: list[int], position: int) -> tier_pb2.Request:
            return tier_pb2.Request(
                id=f"{session}@{position}",
                plan_id=plan_id,
                session=session,
                position=position,
                tensors=encode_tensors(decoder.step_feeds(tokens, position), "raw"),
                keep_last=1,
                choices_only=True,
            )

        # One channel: a caller's sessions are its own, and without a token the caller is
        # its connection ([Note: who a caller is]).
        channel = grpc.insecure_channel(cloud.address, options=grpc_options(8 << 20))
        stub = tier_pb2_grpc.TierStub(channel)

        def send(members: list[tier_pb2.Request]) -> tier_pb2.Reply:
            request = tier_pb2.Request(id="batch", plan_id=plan_id)
            request.members.extend(members)
            replies = list(stub.Infer(iter([request]), timeout=30))
            assert [r.id for r in replies] == ["batch"]
            return replies[0]

        def choice(reply: tier_pb2.Reply) -> int:
            assert not reply.HasField("error"), reply.error
            return int(decode_tensors(list(reply.outputs))["logits"].reshape(-1)[-1])

        sessions = ["s0", "s1", "bad", "lost", "late"]
        before = dict(batcher.stats.sizes)
        first = send([step(s, prompt, 0) for s in sessions])
        assert [r.id for r in first.members] == [f"{s}@0" for s in sessions]
        tokens = {s: choice(r) for s, r in zip(sessions, first.members, strict=True)}
        assert batcher.stats.sizes.get(5, 0) == before.get(5, 0) + 1  # one call of five

        pipeline = cloud.tier.pipeline
        assert pipeline is not None
        pipeline.states.drop("lost")
        position = len(prompt)
        members = [step(s, [tokens[s]], position) for s in sessions]
        members[2] = step("bad", [VOCAB + 7], position)
        members[4].deadline_unix_s = time.time() - 1
        second = send(members)
        channel.close()
    expected = reference_generate(models["model"], prompt, 2, context=CONTEXT).tokens
    assert [r.id for r in second.members] == [f"{s}@{position}" for s in sessions]
    assert [tokens[s] for s in sessions] == [expected[0]] * 5
    assert [choice(r) for r in second.members[:2]] == [expected[1]] * 2
    codes = [tier_pb2.ErrorCode.Name(r.error.code) for r in second.members[2:]]
    assert codes == ["INVALID_INPUT", "STATE_LOST", "DEADLINE_EXCEEDED"]


def test_an_edges_batch_goes_on_to_the_cloud_as_one_message(models: dict[str, Path]) -> None:
    """Four sessions over three tiers: the edge runs three of their steps as one call and
    sends them on as one request ([Note: a batch in one message]), their tensors stacked
    ([Note: a batch's tensors stacked]), which the cloud runs as one call of its own;
    every session's output is the model's own."""
    prompt = PROMPTS[0]
    with serving(models["split"], RuntimeOptions(workers=2, max_batch=8)) as (plan, cloud, edge):
        arm = gate(batcher_of(edge), 4)
        cloud_batcher = batcher_of(cloud)
        received: list[tuple[int, bool]] = []
        run_members = cloud.tier.run_members

        def counted(request: tier_pb2.Request, *args: Any) -> None:
            received.append((len(request.members), bool(request.tensors)))
            run_members(request, *args)

        cloud.tier.run_members = counted  # type: ignore[method-assign]
        prefilled = threading.Barrier(4, action=arm)
        alone = RuntimeOptions(max_batch=1)  # the device sends each step as its own request
        with DeviceClient(plan, edge.address, options=alone) as client:
            outputs = lockstep(4, lambda i: four_tokens(client, prompt, prefilled))
    expected = reference_generate(models["model"], prompt, 4, context=CONTEXT).tokens
    assert all(outputs[i] == list(expected) for i in range(4)), outputs
    assert (3, True) in received, received  # the edge's batch of three, in one message
    assert max(cloud_batcher.stats.sizes) >= 3, cloud_batcher.stats.sizes


def counting_members(*servers: tuple[str, TierServer]) -> dict[str, list[tuple[int, bool]]]:
    """Each tier's batched messages: how many members each carried, and whether their
    tensors came stacked ([Note: a batch's tensors stacked])."""
    received: dict[str, list[tuple[int, bool]]] = {name: [] for name, _ in servers}
    for name, server in servers:
        run_members = server.tier.run_members

        def counted(
            request: tier_pb2.Request, *args: Any, _n: str = name, _r: Any = run_members
        ) -> None:
            received[_n].append((len(request.members), bool(request.tensors)))
            _r(request, *args)

        server.tier.run_members = counted  # type: ignore[method-assign]
    return received


@pytest.mark.parametrize("where", ["split", "cloud"])
def test_a_devices_batch_goes_up_to_the_edge_as_one_message(
    models: dict[str, Path], where: str
) -> None:
    """Four local sessions on one device: the device runs three of their steps as one
    call and sends them to the edge as one request, which the edge runs as one call and
    sends on to the cloud as one ([Note: a batch in one message]); every session's output
    is the model's own, and each step's result has its own share of the link's bytes.
    Cloud-only, the device and the edge run none of the plan's segments: the device's call
    runs nothing, and the edge passes the message on whole."""
    prompt = PROMPTS[0]
    options = RuntimeOptions(workers=2, max_batch=8)
    with serving(models[where], options) as (plan, cloud, edge):
        received = counting_members(("edge", edge), ("cloud", cloud))
        with DeviceClient(plan, edge.address, options=options) as client:
            device = client.pipeline.runner(0).batcher
            assert device is not None
            arm = gate(device, 4)
            prefilled = threading.Barrier(4, action=arm)
            results: list[Any] = []

            outputs = lockstep(4, lambda i: four_tokens(client, prompt, prefilled, results))
    expected = reference_generate(models["model"], prompt, 4, context=CONTEXT).tokens
    assert all(outputs[i] == list(expected) for i in range(4)), outputs
    # The device's batch of three, in one message, their tensors stacked; and on from the
    # edge as one.
    assert (3, True) in received["edge"], received
    assert (3, True) in received["cloud"], received
    assert all(r.bytes["device-edge"] > 0 and r.bytes["edge-cloud"] > 0 for r in results)


@pytest.mark.parametrize("where", ["split", "cloud"])
def test_sessions_stepped_together_run_as_one_call_on_every_tier(
    models: dict[str, Path], where: str
) -> None:
    """Four sessions of one device stepped from one thread ([Note: sessions stepped
    together] in device/client.py): each step of the four is one message to the edge and
    on to the cloud, one call on every tier that runs a segment, and every session's
    output is the model's own. No delay, no gate: they are each other's company."""
    options = RuntimeOptions(workers=2, max_batch=8)
    prompts = PROMPTS[:4]
    with serving(models[where], options) as (plan, cloud, edge):
        received = counting_members(("edge", edge), ("cloud", cloud))
        with DeviceClient(plan, edge.address, options=options) as client:
            decoders = [TierDecoder(client) for _ in prompts]
            made = [
                [int(d.choose(p, 0, keep=1)[-1])] for d, p in zip(decoders, prompts, strict=True)
            ]
            for _ in range(TOKENS - 1):
                steps = [
                    (d, [m[-1]], len(p) + len(m) - 1)
                    for d, p, m in zip(decoders, prompts, made, strict=True)
                ]
                for m, chosen in zip(made, TierDecoder.choose_together(steps, keep=1), strict=True):
                    assert isinstance(chosen, np.ndarray), chosen
                    m.append(int(chosen[-1]))
            device = client.pipeline.runner(0).batcher
        cloud_sizes = batcher_of(cloud).stats.sizes
    for prompt, tokens in zip(prompts, made, strict=True):
        expected = reference_generate(models["model"], prompt, TOKENS, context=CONTEXT).tokens
        assert tokens == list(expected)
    assert received["edge"] == [(4, True)] * (TOKENS - 1), received
    assert received["cloud"] == [(4, True)] * (TOKENS - 1), received
    assert cloud_sizes.get(4) == TOKENS - 1, cloud_sizes
    if where == "split":
        assert device is not None and device.stats.sizes.get(4) == TOKENS - 1


def test_a_session_stepped_together_fails_or_replays_alone(models: dict[str, Path]) -> None:
    """Five sessions stepped together: one asks past the tokens it fed (its StateError),
    one feeds a token past the vocabulary (the device's segment refuses it), and one lost
    its cloud state (replayed alone); the other two, and the replayed one, get the
    model's own token."""
    options = RuntimeOptions(workers=2, max_batch=8)
    prompt = PROMPTS[0]
    with (
        serving(models["split"], options) as (plan, cloud, edge),
        DeviceClient(plan, edge.address, options=options) as client,
    ):
        decoders = [TierDecoder(client) for _ in range(5)]
        first = [int(d.choose(prompt, 0, keep=1)[-1]) for d in decoders]
        pipeline = cloud.tier.pipeline
        assert pipeline is not None
        pipeline.states.drop(decoders[2].session)
        steps = [(d, [first[i]], len(prompt)) for i, d in enumerate(decoders)]
        steps[3] = (decoders[3], [first[3]], len(prompt) + 5)
        steps[4] = (decoders[4], [VOCAB + 7], len(prompt))
        answers = TierDecoder.choose_together(steps, keep=1)
    expected = reference_generate(models["model"], prompt, 2, context=CONTEXT).tokens
    for i in (0, 1, 2):
        chosen = answers[i]
        assert isinstance(chosen, np.ndarray), chosen
        assert [first[i], int(chosen[-1])] == list(expected)
    assert [d.replays for d in decoders] == [0, 0, 1, 0, 0]
    assert isinstance(answers[3], StateError), answers[3]
    assert isinstance(answers[4], InputError), answers[4]
    assert "refused its inputs" in str(answers[4])


def test_sessions_stepped_together_share_one_client(models: dict[str, Path]) -> None:
    with (
        serving(models["cloud"], RuntimeOptions()) as (plan, _, edge),
        DeviceClient(plan, edge.address) as one,
        DeviceClient(plan, edge.address) as other,
    ):
        steps = [(TierDecoder(one), [1], 0), (TierDecoder(other), [1], 0)]
        with pytest.raises(UsageError, match="one DeviceClient"):
            TierDecoder.choose_together(steps)


def test_sessions_stepped_together_are_tried_again_together_while_a_tier_is_missing(
    models: dict[str, Path],
) -> None:
    """The cloud gone after the prefills: three sessions' steps fail as missing, and are
    sent again together (one message of three each try) until their ``retry_s`` ends,
    not one session's tries after another's; each ends with its own missing error."""
    options = RuntimeOptions(workers=2, max_batch=8)
    with (
        serving(models["cloud"], options) as (plan, cloud, edge),
        DeviceClient(plan, edge.address, options=options) as client,
    ):
        decoders = [TierDecoder(client, retry_s=4.0) for _ in range(3)]
        first = [int(d.choose(PROMPTS[0], 0, keep=1)[-1]) for d in decoders]
        cloud.stop(0)
        tries: list[int] = []
        submit_together = client.submit_together

        def counted(requests: Sequence[Any]) -> Any:
            tries.append(len(requests))
            return submit_together(requests)

        client.submit_together = counted  # type: ignore[method-assign]
        steps = [(d, [first[i]], len(PROMPTS[0])) for i, d in enumerate(decoders)]
        answers = TierDecoder.choose_together(steps, keep=1)
    assert all(is_missing(answer) for answer in answers), answers  # type: ignore[arg-type]
    assert len(tries) >= 2 and set(tries) == {3}, tries
    assert [d.retries for d in decoders] == [len(tries) - 1] * 3
