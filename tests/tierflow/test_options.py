"""RuntimeOptions: checked when made, built once from the command line, read-only."""

from __future__ import annotations

import dataclasses

import pytest

from tierflow.cli.main import build_parser
from tierflow.cli.runtime_arguments import runtime_options
from tierflow.errors import UsageError
from tierflow.link.spec import LinkSpec
from tierflow.options import DEFAULT_MAX_IN_FLIGHT, RuntimeOptions
from tierflow.plan import Plan, SegmentSpec
from tierflow.transport.security import Security

PLAN = Plan(
    model_file="m.onnx",
    model_sha256="0" * 64,
    inputs=("x",),
    outputs=("y",),
    segments=(SegmentSpec("device", "a.onnx", ("x",), ("y",)),),
    links={"device-edge": LinkSpec(20e6, 0.01), "edge-cloud": LinkSpec(1e9, 0.02)},
)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"threads": -1}, "threads must be >= 0"),
        ({"slowdown": 0.5}, "slowdown must be at least 1.0, got 0.5"),
        ({"slowdown": float("nan")}, "slowdown must be at least 1.0"),
        ({"optimization": "max"}, "unknown optimization level 'max'"),
        ({"workers": 0}, "workers must be >= 1, got 0"),
        ({"max_tensor_bytes": 0}, "max_tensor_bytes must be >= 1"),
        ({"max_in_flight": 0}, "max_in_flight must be >= 1"),
        ({"reply_timeout": 0.0}, "reply_timeout must be a positive number"),
        ({"reply_timeout": float("inf")}, "reply_timeout must be a positive number"),
    ],
)
def test_values_no_runtime_can_use_are_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        RuntimeOptions(**change)  # type: ignore[arg-type]


def test_links_are_a_read_only_copy() -> None:
    links = {"device-edge": LinkSpec(1e6, 0.0)}
    options = RuntimeOptions(links=links)
    links["edge-cloud"] = LinkSpec(2e6, 0.0)
    assert set(options.links) == {"device-edge"}
    with pytest.raises(TypeError):
        options.links["edge-cloud"] = LinkSpec(2e6, 0.0)  # type: ignore[index]
    assert dataclasses.replace(options, threads=2).links == options.links


def test_serve_and_run_build_the_options_from_their_flags() -> None:
    parser = build_parser()
    flags = "--threads 3 --slowdown 4 --workers 5 --optimization basic --max-tensor-bytes 1MiB"
    flags += " --link-emulation plan --emulate-link device-edge=1mbit,4ms --token-file t"
    flags += " --reply-timeout 2.5"
    serve = parser.parse_args(["serve", "edge", "--plan", "p", *flags.split()])
    options = runtime_options(serve, PLAN, server=True)
    assert (options.threads, options.slowdown, options.workers) == (3, 4.0, 5)
    assert (options.optimization, options.max_tensor_bytes) == ("basic", 1 << 20)
    assert dict(options.links) == {
        "device-edge": LinkSpec(1e6, 0.004),
        "edge-cloud": LinkSpec(1e9, 0.02),
    }
    assert options.security == Security(token_file="t")
    assert options.max_in_flight == DEFAULT_MAX_IN_FLIGHT
    assert options.reply_timeout == 2.5

    run = parser.parse_args(["run", "--plan", "p", "--input", "in.npz", "--slowdown", "20"])
    device = runtime_options(run, PLAN, server=False)
    assert device == RuntimeOptions(slowdown=20.0)  # no --workers: the default stays
    bad = parser.parse_args(["serve", "cloud", "--plan", "p", "--workers", "0"])
    with pytest.raises(UsageError, match="workers must be >= 1"):
        runtime_options(bad, PLAN, server=True)


def test_runtime_flags_default_to_runtime_options() -> None:
    """``serve``, ``run``, ``device`` and ``generate`` with no flags make ``RuntimeOptions()``.

    Their defaults are read from the dataclass, not written again in each command (so
    ``--help`` shows what a library user gets): ``--workers`` is None (one per core)
    and ``--max-tensor-bytes`` the codec's bound, not a second literal.
    """
    parser = build_parser()
    for argv, server in (
        (["serve", "edge", "--plan", "p"], True),
        (["serve", "cloud", "--plan", "p"], True),
        (["run", "--plan", "p", "--input", "in.npz"], False),
        (["device", "--plan", "p", "--source", "-"], False),
        (["generate", "--plan", "p", "--prompt-ids", "1,2"], False),
    ):
        options = runtime_options(parser.parse_args(argv), PLAN, server=server)
        assert options == RuntimeOptions(), argv
    serve = parser.parse_args(["serve", "edge", "--plan", "p"])
    assert serve.workers is None and serve.max_tensor_bytes == RuntimeOptions().max_tensor_bytes


def test_old_link_spelling_on_a_runtime_still_works_with_a_notice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--link`` on ``serve``/``run``/``device`` is ``--emulate-link``, with one line on stderr."""
    parser = build_parser()
    old = ["--link", "device-edge=1mbit,4ms", "--link", "edge-cloud=5mbit"]
    new = ["--emulate-link", "device-edge=1mbit,4ms", "--emulate-link", "edge-cloud=5mbit"]
    for command, server in (
        (["serve", "edge", "--plan", "p"], True),
        (["run", "--plan", "p", "--input", "i"], False),
    ):
        before = parser.parse_args([*command, *old])
        notice = capsys.readouterr().err
        after = parser.parse_args([*command, *new])
        assert before.emulate_link == after.emulate_link
        assert runtime_options(before, PLAN, server=server) == runtime_options(
            after, PLAN, server=server
        )
        assert notice.count("\n") == 1 and "--link is deprecated" in notice
        assert "--emulate-link" in notice and capsys.readouterr().err == ""


def test_an_emulated_link_needs_no_other_flag() -> None:
    """``--emulate-link`` alone shapes that link only.

    See [Note: emulated links] in ``tierflow.link.emulation``.
    """
    parser = build_parser()
    args = parser.parse_args(
        ["run", "--plan", "p", "--input", "i", "--emulate-link", "device-edge=2mbit"]
    )
    options = runtime_options(args, PLAN, server=False)
    assert dict(options.links) == {"device-edge": LinkSpec(2e6, 0.01)}  # the plan's RTT kept
