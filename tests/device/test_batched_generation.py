"""Concurrent generation through tiers that batch decode steps ([Note: the step batcher] in
tierflow/runtime/batching.py): every session's greedy output is the unsplit model's own,
batched or not, and a session whose step fails fails alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierflow.device.client import DeviceClient
from tierflow.device.generation import Generator
from tierflow.edge.forwarding import Forwarding
from tierflow.errors import RemoteError
from tierflow.greedy import reference_generate
from tierflow.options import RuntimeOptions
from tierflow.partitioner.decoder_graph import load_decoder, split_decoder
from tierflow.partitioner.decoder_points import DecoderSettings
from tierflow.partitioner.split import save_split_plan
from tierflow.runtime.server import TierServer
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
        "split": decoder_plan(model, root / "split", "split"),
        "cloud": decoder_plan(model, root / "cloud", "cloud"),
    }


@pytest.fixture()
def tiers(request: Any, models: dict[str, Path]) -> Iterator[tuple[Path, TierServer, TierServer]]:
    plan = models[request.param]
    # A tiny model's steps take well under a millisecond: --batch-delay lets the sessions'
    # steps meet on every tier, where a real model's long steps make them queue.
    options = RuntimeOptions(workers=8, max_batch=8, batch_delay_s=0.02)
    cloud = TierServer.from_plan("cloud", plan, options=options)
    cloud.start()
    edge = TierServer.from_plan("edge", plan, forwarder=Forwarding(cloud.address), options=options)
    edge.start()
    try:
        yield plan, cloud, edge
    finally:
        edge.stop(0)
        cloud.stop(0)


def cloud_batches(cloud: TierServer) -> int:
    """Steps the cloud ran in batches of more than one."""
    pipeline = cloud.service.pipeline
    assert pipeline is not None
    batcher = pipeline.runner(0).batcher
    assert batcher is not None
    return batcher.stats.batched


@pytest.mark.parametrize("tiers", ["split", "cloud"], indirect=True)
def test_concurrent_sessions_are_token_identical_to_running_alone(
    models: dict[str, Path], tiers: tuple[Path, TierServer, TierServer]
) -> None:
    plan, cloud, edge = tiers
    outputs: dict[int, list[int] | BaseException] = {}
    with DeviceClient(plan, edge.address) as client:

        def generate(i: int) -> None:
            try:
                outputs[i] = list(Generator(client).generate(PROMPTS[i], TOKENS).tokens)
            except Exception as exc:
                outputs[i] = exc

        threads = [threading.Thread(target=generate, args=(i,)) for i in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
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
