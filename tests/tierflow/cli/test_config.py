"""``--config FILE.toml``: the flags' names in a file, flags win, every mistake one clear line."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tierflow.cli.config import add_config_option, apply_config
from tierflow.cli.main import build_parser, main
from tierflow.errors import UsageError
from tierflow.link.spec import LinkOption
from tierflow.transport.address import Address
from tierflow.transport.deadline import Deadline
from tierflow.units import parse_size


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    apply_config(parser, argv)
    return parser.parse_args(argv)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tier.toml"
    path.write_text(text)
    return path


def test_serve_reads_the_file_and_flags_win(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        'plan = "plan/"\nlisten = "127.0.0.1:7000"\nthreads = 2\nmax_tensor_bytes = "2MiB"\n'
        'slowdown = 3\nemulate-link = ["device-edge=20mbit,10ms", "edge-cloud=1gbit"]\n'
        'optimization = "basic"\nupstream = "127.0.0.1:7001"\n',
    )
    args = _parse(["serve", "edge", "--config", str(path), "--threads", "4"])
    assert args.plan == "plan/"  # a required flag may come from the file
    assert args.listen == "127.0.0.1:7000"
    assert args.threads == 4  # the command line wins
    assert args.max_tensor_bytes == parse_size("2MiB")  # through the option's own parser
    assert args.slowdown == 3.0
    assert args.optimization == "basic"
    assert args.upstream == Address("127.0.0.1:7001")
    assert args.emulate_link == [
        LinkOption.parse("device-edge=20mbit,10ms"),
        LinkOption.parse("edge-cloud=1gbit"),
    ]
    # A repeatable flag on the command line replaces the file's list.
    args = _parse(["serve", "edge", "--config", str(path), "--emulate-link", "edge-cloud=5mbit"])
    assert args.emulate_link == [LinkOption.parse("edge-cloud=5mbit")]
    args = _parse(["serve", "edge", f"--config={path}", "--listen=127.0.0.1:9"])
    assert args.listen == "127.0.0.1:9"


def test_an_old_key_still_works_with_a_notice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``link`` (``--link``) is the old name of ``emulate-link`` on a runtime: accepted, noted."""
    path = _write(tmp_path, 'plan = "p"\nlink = ["device-edge=20mbit,10ms"]\n')
    args = _parse(["serve", "edge", "--config", str(path)])
    assert args.emulate_link == [LinkOption.parse("device-edge=20mbit,10ms")]
    notice = capsys.readouterr().err
    assert notice.count("\n") == 1 and "'link' is deprecated" in notice
    assert "'emulate-link'" in notice and str(path) in notice
    # The new flag on the command line wins over the old key, as over the new one.
    args = _parse(["serve", "edge", "--config", str(path), "--emulate-link", "edge-cloud=1gbit"])
    assert args.emulate_link == [LinkOption.parse("edge-cloud=1gbit")]
    both = _write(tmp_path, 'link = ["device-edge=1mbit"]\nemulate-link = ["edge-cloud=1gbit"]\n')
    with pytest.raises(UsageError, match="'link' and 'emulate-link' set the same option"):
        apply_config(build_parser(), ["serve", "edge", "--config", str(both)])


def test_run_and_cloud_take_a_config(tmp_path: Path) -> None:
    path = _write(tmp_path, 'plan = "p"\ninput = "in.npz"\nwindow = 4\ndeadline = "2s"\n')
    args = _parse(["run", "--config", str(path)])
    assert (args.plan, args.input, args.window, args.deadline) == ("p", "in.npz", 4, Deadline(2.0))
    cloud = _write(tmp_path, 'plan = "p"\nworkers = 3\n')
    assert _parse(["serve", "cloud", "--config", str(cloud)]).workers == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("thread = 2\n", r"unknown key 'thread' \(did you mean 'threads'\?\)"),
        ('threads = "two"\n', r"threads: expected an integer, found a string \('two'\)"),
        ("threads = 1.5\n", r"threads: expected an integer, found a number"),
        ("threads = true\n", r"threads: expected an integer, found a boolean"),
        ('optimization = "best"\n', r"optimization: expected one of disabled, basic"),
        ('max-tensor-bytes = "lots"\n', r"max-tensor-bytes: 'lots' is not accepted"),
        ("plan = 5\n", r"plan: expected a string, found an integer"),
        ("listen = 5\n", r"listen: '5' is not accepted: --listen '5': expected HOST:PORT"),
        ("listen = [1, 2]\n", r"listen: expected a string.*found an array"),
        ('plan = "p"\n[extra]\nx = 1\n', r"unknown key 'extra'"),
        ("threads = \n", r"is not valid TOML"),
        ('config = "other.toml"\n', r"unknown key 'config'"),
        ("threads = 2\nthreads = 3\n", r"is not valid TOML"),
    ],
)
def test_mistakes_are_one_clear_line(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(UsageError, match=message):
        apply_config(build_parser(), ["serve", "edge", "--config", str(path)])


@pytest.mark.integration
def test_cli_prints_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "thread = 2\n")
    assert main(["serve", "edge", "--config", str(path), "--plan", "p"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "'thread'" in err[0]
    assert main(["serve", "edge", "--config", str(tmp_path / "none.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.integration
def test_an_abbreviated_config_flag_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, 'plan = "p"\n')
    assert main(["serve", "cloud", "--plan", "p", "--conf", str(path)]) == 2
    assert "write --config in full" in capsys.readouterr().err


def test_generic_over_argparse(tmp_path: Path) -> None:
    """Every kind of argparse option, on a parser this module has never seen."""
    root = argparse.ArgumentParser()
    commands = root.add_subparsers(dest="command")
    tool = commands.add_parser("tool")
    tool.add_argument("--name", required=True)
    tool.add_argument("--fast", action="store_true")
    tool.add_argument("--no-check", dest="check", action="store_false")
    tool.add_argument("--tag", action="append", default=[])
    tool.add_argument("--pair", nargs=2, type=int)
    tool.add_argument("--loud", action="count", default=0)
    tool.add_argument("--ratio", type=float, default=1.0)
    tool.add_argument("--mode", choices=("a", "b"), default="a")
    add_config_option(root, ["tool", "missing command"])
    path = _write(
        tmp_path,
        'name = "x"\nfast = true\nno-check = true\ntag = "one"\npair = [1, 2]\nloud = 2\n'
        'ratio = 2\nmode = "b"\n',
    )
    argv = ["tool", "--config", str(path)]
    apply_config(root, argv)
    args = root.parse_args(argv)
    assert (args.name, args.fast, args.check, args.tag) == ("x", True, False, ["one"])
    assert (args.pair, args.loud, args.ratio, args.mode) == ([1, 2], 2, 2.0, "b")
    bad = _write(tmp_path, "pair = [1]\n")
    with pytest.raises(UsageError, match="pair: expected 2 values, found 1"):
        apply_config(root, ["tool", "--config", str(bad)])
    bad = _write(tmp_path, 'fast = "yes"\n')
    with pytest.raises(UsageError, match="fast: expected true or false"):
        apply_config(root, ["tool", "--config", str(bad)])


def test_commands_without_config_ignore_it() -> None:
    parser = build_parser()
    assert apply_config(parser, ["plan", "m.onnx", "-o", "p"]) is None
    assert apply_config(parser, ["serve", "edge", "--plan", "p"]) is None
    with pytest.raises(SystemExit):
        parser.parse_args(["plan", "m.onnx", "-o", "p", "--config", "x.toml"])
