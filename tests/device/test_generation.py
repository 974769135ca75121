"""Generation across three tiers: greedy output identical to the unsplit model's, with and
without a draft, across a lost state; sampling seeded; the command line."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.cli.main import main
from tierflow.device.client import DeviceClient
from tierflow.device.generation import Generator
from tierflow.edge.forwarding import Forwarding
from tierflow.errors import InputError, PlanError, StateError, TransportError
from tierflow.greedy import reference_generate
from tierflow.options import RuntimeOptions
from tierflow.partitioner.decoder_graph import load_decoder, split_decoder
from tierflow.partitioner.decoder_points import DecoderSettings
from tierflow.partitioner.graph import load_model
from tierflow.partitioner.split import save_split_plan, split_model
from tierflow.runtime.server import TierServer
from tierflow.zoo.tiny_stateful import streaming_model, tiny_decoder

pytestmark = pytest.mark.integration

CONTEXT = 64
PROMPT = [1, 2, 3, 4, 5]


def decoder_plan(model: Path, plan_dir: Path) -> Path:
    """The decoder split over device, edge and cloud at two block boundaries."""
    graph = load_decoder(model, DecoderSettings(context=CONTEXT, max_tokens=16, prompt_tokens=5))
    last = len(graph.prefill.cuts) - 1
    cuts = (last // 3, 2 * last // 3)
    segments = split_decoder(graph, cuts)
    assert [spec.tier for spec, _ in segments] == ["device", "edge", "cloud"]
    codec = {"device-edge": "raw", "edge-cloud": "zstd"}
    save_split_plan(
        graph.prefill, segments, plan_dir, cuts=cuts, codec=codec, decoder=graph.decoder
    )
    return plan_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gen")
    large = tiny_decoder(root / "large.onnx", blocks=6, vocab=32, seed=1)
    return {
        "large": large,
        "same": tiny_decoder(root / "same.onnx", blocks=6, vocab=32, seed=1),
        "other": tiny_decoder(root / "other.onnx", blocks=2, vocab=32, seed=3),
        "narrow": tiny_decoder(root / "narrow.onnx", blocks=2, vocab=16, seed=1),
        "plan": decoder_plan(large, root / "plan"),
    }


@pytest.fixture()
def tiers(models: dict[str, Path]) -> Iterator[tuple[TierServer, TierServer]]:
    options = RuntimeOptions(workers=2)
    cloud = TierServer.from_plan("cloud", models["plan"], options=options)
    cloud.start()
    edge = TierServer.from_plan(
        "edge", models["plan"], forwarder=Forwarding(cloud.address), options=options
    )
    edge.start()
    try:
        yield cloud, edge
    finally:
        edge.stop(0)
        cloud.stop(0)


def reference(models: dict[str, Path], count: int) -> list[int]:
    return list(reference_generate(models["large"], PROMPT, count, context=CONTEXT).tokens)


def test_greedy_across_three_tiers_is_the_models_own_greedy_output(
    models: dict[str, Path], tiers: Any
) -> None:
    _, edge = tiers
    with DeviceClient(models["plan"], edge.address) as client:
        generator = Generator(client)
        report = generator.generate(PROMPT, 24)
    assert report.tokens == reference(models, 24)
    # Greedy answers carry the large model's choices alone: the prefill's, the last
    # position's (not one per prompt token), and each step's its one.
    for result in generator.target.results:
        choices = result.outputs["logits"]
        assert choices.shape == (1, 1) and choices.dtype == np.int64
    assert len(set(report.tokens)) > 3  # a model that says something
    assert report.round_trips == 24 and report.tiers == {
        "device": [0, 1],
        "edge": [2, 3],
        "cloud": [4, 5],
    }
    assert report.bytes_per_token["device-edge"] > 0 and report.bytes_per_token["edge-cloud"] > 0
    assert report.ttft_ms > 0 and report.ms_per_token > 0
    # Where the time went: each tier's compute as it timed it, the queues, the rest.
    assert set(report.parts_ms) == {"prefill", "step"}
    for parts in report.parts_ms.values():
        assert list(parts) == ["device", "edge", "cloud", "queue", "network"]
        assert parts["edge"] > 0 and parts["cloud"] > 0 and parts["network"] > 0
    assert report.parts_ms["step"]["cloud"] == pytest.approx(
        float(np.median([r.ms["cloud"] for r in generator.target.results[1:]]))
    )


@pytest.mark.parametrize("draft, tokens", [("same", 4), ("other", 3), ("other", None)])
def test_a_draft_gives_the_same_greedy_output_in_fewer_round_trips(
    models: dict[str, Path], tiers: Any, draft: str, tokens: int | None
) -> None:
    _, edge = tiers
    with DeviceClient(models["plan"], edge.address) as client:
        generator = Generator(client, draft=models[draft], draft_tokens=tokens)
        report = generator.generate(PROMPT, 30)
    assert report.tokens == reference(models, 30)
    assert report.drafted > 0
    # A speculated round's answer: the choice at the pending token and at each draft.
    assert {r.outputs["logits"].ndim for r in generator.target.results} == {2}
    assert max(r.outputs["logits"].shape[1] for r in generator.target.results) > 1
    assert report.accepted <= report.judged <= report.drafted
    if draft == "same":  # every draft kept: 1 + 4 tokens per round trip
        assert report.accepted == report.drafted
        assert report.round_trips <= 1 + -(-29 // 5)
    else:  # a draft of other weights: most drafts rejected, rolled back on every tier
        assert report.accepted < report.drafted
        assert report.round_trips <= 30


def test_a_state_lost_on_a_tier_is_replayed_and_the_output_does_not_change(
    models: dict[str, Path], tiers: Any
) -> None:
    cloud, edge = tiers
    with DeviceClient(models["plan"], edge.address) as client:
        generator = Generator(client)
        session = generator.target.session

        def evict(token: int, draft_only: bool) -> None:
            if len(generator.target.fed) == len(PROMPT) + 8:
                assert cloud.tier.pipeline is not None
                cloud.tier.pipeline.states.drop(session)

        report = generator.generate(PROMPT, 20, on_token=evict)
    assert report.replays == 1
    assert report.tokens == reference(models, 20)


def test_sampling_is_seeded_and_a_draft_keeps_it_valid(models: dict[str, Path], tiers: Any) -> None:
    _, edge = tiers
    with DeviceClient(models["plan"], edge.address) as client:
        first = Generator(client, temperature=0.9, seed=5).generate(PROMPT, 16).tokens
        again = Generator(client, temperature=0.9, seed=5).generate(PROMPT, 16).tokens
        drafted = Generator(client, draft=models["other"], temperature=0.9, seed=5)
        sampled = drafted.generate(PROMPT, 16)
    assert first == again and len(first) == 16
    # Sampling needs the large model's distribution: its answers carry the logits.
    assert drafted.target.results[0].outputs["logits"].shape == (1, 1, 32)
    assert drafted.target.results[-1].outputs["logits"].dtype == np.float32
    assert all(0 <= t < 32 for t in sampled.tokens) and len(sampled.tokens) == 16


def test_bad_generation_requests_are_one_line_errors(models: dict[str, Path], tiers: Any) -> None:
    _, edge = tiers
    with DeviceClient(models["plan"], edge.address) as client:
        with pytest.raises(StateError, match="made for --context 64"):
            Generator(client).generate(list(range(30)) * 2, 10)
        with pytest.raises(InputError, match="vocabulary of 16 tokens, the plan's decoder 32"):
            Generator(client, draft=models["narrow"])
        with pytest.raises(InputError, match="outside the vocabulary"):
            Generator(client).generate([40], 4)


def test_a_plan_that_is_no_decoder_is_refused(tmp_path: Path) -> None:
    graph = load_model(streaming_model(tmp_path / "stream.onnx"))
    last = len(graph.cuts) - 1
    save_split_plan(graph, split_model(graph, (last, last)), tmp_path / "plan")
    with DeviceClient(tmp_path / "plan") as client, pytest.raises(PlanError, match="not a decoder"):
        Generator(client)


def test_the_command_generates_and_ends_with_one_json_line(
    models: dict[str, Path], tiers: Any, capsys: Any
) -> None:
    _, edge = tiers
    ids = ",".join(str(t) for t in PROMPT)
    code = main(["generate", "--plan", str(models["plan"]), "--edge", edge.address,
                 "--prompt-ids", ids, "--max-tokens", "12", "--draft", str(models["other"]),
                 "--draft-tokens", "3", "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    line = json.loads(out.strip().splitlines()[-1])
    assert line["tokens"] == reference(models, 12)
    for key in ("ttft_ms", "ms_per_token", "round_trips", "accepted", "bytes_per_token", "tiers"):
        assert key in line
    assert set(line["parts_ms"]) == {"prefill", "step"} and line["parts_ms"]["step"]["cloud"] > 0
    assert set(line["bytes_per_token"]) == {"device-edge", "edge-cloud"}


def test_a_prefill_past_the_deadline_says_how_to_give_it_time(
    models: dict[str, Path], tiers: Any, capsys: Any
) -> None:
    # A long prompt on a large model (1,500 tokens on Qwen2-0.5B's shapes: 38 s) takes
    # longer to prefill than a step's default --deadline (30 s); here a deadline of 1 us.
    _, edge = tiers
    code = main(["generate", "--plan", str(models["plan"]), "--edge", edge.address,
                 "--prompt-ids", "1,2,3,4,5", "--max-tokens", "4", "--deadline", "0.000001",
                 "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 1
    line = json.loads(out.strip().splitlines()[-1])
    assert line["tokens"] == [] and line["stopped"] == "error"
    assert "the prefill of the prompt's 5 tokens took longer than --deadline" in line["error"]
    (message,) = [m for m in err.splitlines() if "error" in m]
    assert "a long prompt on a large model needs a longer one" in message


def test_a_prompt_in_bytes_and_a_tokenizer_that_does_not_load(
    models: dict[str, Path], tiers: Any, tmp_path: Path, capsys: Any
) -> None:
    _, edge = tiers
    base = ["generate", "--plan", str(models["plan"]), "--edge", edge.address, "--max-tokens", "4"]
    broken = tmp_path / "tok.json"
    broken.write_text("{not json")
    assert main([*base, "--prompt", "hi", "--tokenizer", str(broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not load" in err[0]
    # A byte-level prompt: 'hi' is ids 104, 105, outside this 32-token vocabulary.
    assert main([*base, "--prompt", "hi", "--tokenizer", "bytes"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err


def stop_after_four(
    generator: Generator, tiers: tuple[TierServer, TierServer]
) -> Callable[[int, bool], None]:
    """An ``on_token`` hook that stops both tiers once four tokens were fed after the prompt."""

    def stop(token: int, draft_only: bool) -> None:
        if len(generator.target.fed) >= len(PROMPT) + 4:
            for tier in reversed(tiers):
                tier.stop(0)  # nothing once stopped

    return stop


def test_with_the_tiers_gone_the_draft_goes_on_alone_marked(
    models: dict[str, Path], tiers: Any
) -> None:
    _, edge = tiers
    with DeviceClient(models["plan"], edge.address, deadline_s=5.0) as client:
        generator = Generator(client, draft=models["other"], fallback_draft=True)
        report = generator.generate(PROMPT, 20, on_token=stop_after_four(generator, tiers))
    assert len(report.tokens) == 20
    assert report.draft_only and report.draft_only == list(range(report.draft_only[0], 20))
    kept = report.tokens[: report.draft_only[0]]
    assert kept == reference(models, 20)[: len(kept)]
    assert np.all(np.asarray(report.tokens) < 32)


def test_a_prompt_through_a_hugging_face_tokenizer(
    models: dict[str, Path], tiers: Any, tmp_path: Path, capsys: Any
) -> None:
    """--tokenizer tokenizer.json: the prompt encoded, the tokens decoded as they come."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models

    words = [f"w{i}" for i in range(32)]
    tokenizer = Tokenizer(tokenizer_models.WordLevel({w: i for i, w in enumerate(words)}, "w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    _, edge = tiers
    code = main(["generate", "--plan", str(models["plan"]), "--edge", edge.address,
                 "--prompt", "w1 w2 w3 w4 w5", "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--max-tokens", "6", "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    line = json.loads(out.strip().splitlines()[-1])
    assert line["prompt"] == PROMPT and line["tokens"] == reference(models, 6)
    assert line["text"] == " ".join(f"w{t}" for t in line["tokens"])


def test_a_draft_with_fewer_positions_is_dropped_and_the_generation_goes_on(
    models: dict[str, Path], tiers: Any, tmp_path: Path
) -> None:
    """A draft of 12 positions on a 20-token generation aborted it (issue 30, item 12)."""
    short = tiny_decoder(tmp_path / "short.onnx", blocks=2, vocab=32, seed=3, positions=12)
    _, edge = tiers
    with DeviceClient(models["plan"], edge.address) as client:
        generator = Generator(client, draft=short, draft_tokens=3)
        report = generator.generate(PROMPT, 20)
    assert report.tokens == reference(models, 20)  # the large model's own greedy output
    assert report.drafted > 0 and report.draft_dropped is not None
    assert "at position 1" in report.draft_dropped and generator.draft is None


def test_a_failed_generation_keeps_the_tokens_it_made_and_why(
    models: dict[str, Path], tiers: Any
) -> None:
    """``generate --json`` prints them: a failed run printed nothing on stdout."""
    _, edge = tiers
    with DeviceClient(models["plan"], edge.address, deadline_s=5.0) as client:
        generator = Generator(client)
        with pytest.raises(TransportError):
            generator.generate(PROMPT, 20, on_token=stop_after_four(generator, tiers))
    failed = generator.report
    assert failed is not None and failed.stopped == "error" and failed.error
    assert 4 <= len(failed.tokens) < 20
    assert failed.tokens == reference(models, 20)[: len(failed.tokens)]
    assert failed.to_dict()["error"] == failed.error
