"""Outputs into a place that cannot take them: one line, before any work (issue 30, 9)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierflow.cli.main import main
from tierflow.cli.paths import output_file, output_file_or_stdout, output_folder
from tierflow.errors import UsageError

# Every command that writes a file or folder, with what it needs besides the output. The
# plan and the inputs named do not exist: the output's check comes first, before any work.
_COMMANDS: dict[str, list[str]] = {
    "run --output": ["run", "--plan", "plan/", "--input", "in.npz", "--output"],
    "run --report": ["run", "--plan", "plan/", "--input", "in.npz", "--report"],
    "device --results": ["device", "--plan", "plan/", "--source", "-", "--results"],
    "profile -o": ["profile", "model.onnx", "-o"],
    "plan -o": ["plan", "model.onnx", "-o"],
    "exits add -o": ["exits", "add", "model.onnx", "--calib", "c.npz", "-o"],
    "demo --results-md": ["demo", "--results-md"],
}


@pytest.mark.parametrize("command", list(_COMMANDS))
def test_an_output_in_a_missing_folder_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    target = tmp_path / "missing" / ("plan" if command == "plan -o" else "out.file")
    code = main([*_COMMANDS[command], str(target)])
    err = capsys.readouterr().err
    if command == "plan -o":  # plan -o creates its folder, parents included
        assert "cannot write" not in err
        return
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"cannot write '{target}': the folder '{target.parent}' does not exist" in err


@pytest.mark.parametrize("command", list(_COMMANDS))
def test_an_output_under_a_file_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "out"
    assert main([*_COMMANDS[command], str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"cannot write '{target}': '{tmp_path / 'file'}' is not a folder" in err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("command", ["plan -o", "profile -o", "run --report"])
def test_an_output_where_nothing_may_be_written_is_one_line(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """/proc takes no files, not even from root: a place this user cannot write."""
    assert main([*_COMMANDS[command], "/proc/tierflow-out"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "cannot write '/proc/tierflow-out': the folder '/proc' takes no files" in err


def test_the_checks_leave_nothing_behind_and_keep_the_path(tmp_path: Path) -> None:
    assert output_file(str(tmp_path / "out.npz")) == tmp_path / "out.npz"
    assert output_folder(str(tmp_path / "a" / "b")) == tmp_path / "a" / "b"
    assert output_file_or_stdout("-") == "-"
    assert list(tmp_path.iterdir()) == []  # no probe file, and plan's folder not made yet
    with pytest.raises(UsageError, match="it is a folder; expected a file name"):
        output_file(str(tmp_path))
    (tmp_path / "plan").write_text("")
    with pytest.raises(UsageError, match="it is a file; expected a folder"):
        output_folder(str(tmp_path / "plan"))
