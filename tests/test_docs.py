"""The README is the door and ``docs/`` the guide; what they show still holds.

``bash scripts/test`` builds the guide with ``mkdocs build --strict`` (``mkdocs.yml``),
which fails on a broken link or anchor between its pages. These tests check what that
build does not: that the README stays a door (two commands, links that resolve), that every
page is in the site's navigation, and that every ``tierflow`` command the README, the guide
and the deployment examples show is one the command line accepts today.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tierflow.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GUIDE = ROOT / "docs"
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _nav_pages() -> list[str]:
    """The pages ``mkdocs.yml``'s nav lists (``  - Title: page.md``), in order."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text.split("\nnav:\n")[1]
    return re.findall(r"^\s+- [^:\n]+: (\S+\.md)\s*$", nav, re.M)


def test_the_readme_is_a_door_with_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 120, "the README is the door: move detail to docs/"
    first_block = FENCE.findall(text)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["bash scripts/demo", "bash scripts/test"]
    assert (ROOT / "scripts/demo").is_file() and (ROOT / "scripts/test").is_file()


def test_the_readmes_links_resolve() -> None:
    links = [link for link in LINK.findall(README.read_text()) if "://" not in link]
    assert links, "the README links to the guide"
    missing = [link for link in links if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    pages = {link.split("#")[0].removeprefix("docs/") for link in links if link.startswith("docs/")}
    assert pages <= set(_nav_pages()), "the README links to pages of the site"
    guide = {"planning", "serving", "generation", "deployment", "security", "benchmarks", "design"}
    assert {f"{page}.md" for page in guide} <= pages, "the README links to each part of the guide"


def test_every_guide_page_is_in_the_navigation_once() -> None:
    nav = _nav_pages()
    assert len(nav) == len(set(nav)), f"a page listed twice: {nav}"
    on_disk = sorted(p.name for p in GUIDE.glob("*.md"))
    assert sorted(nav) == on_disk
    assert {"planning.md", "serving.md", "generation.md", "deployment.md"} <= set(nav)
    assert {"security.md", "benchmarks.md", "design.md"} <= set(nav)


def _shown_commands() -> list[tuple[str, str]]:
    """Every ``tierflow ...`` line in a code block of the README, the guide and the
    deployment examples, continuation lines joined, as ``(file, line)``. Synopses (with
    ``[optional]`` parts or ``a|b`` choices) are not commands and are left out."""
    files = [README, *sorted(GUIDE.glob("*.md")), *sorted((ROOT / "demos").glob("*.md"))]
    shown = []
    for path in files:
        for block in FENCE.findall(path.read_text()):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = line.strip()
                if re.match(r"(\S*/)?tierflow ", line) and not re.search(r"\[|\|", line):
                    shown.append((str(path.relative_to(ROOT)), line))
    return shown


def test_the_examples_show_commands() -> None:
    files = {name for name, _ in _shown_commands()}
    assert {"README.md", "docs/index.md", "docs/serving.md", "demos/README.md"} <= files


@pytest.mark.parametrize(("name", "line"), _shown_commands())
def test_a_shown_command_is_accepted_by_the_command_line(name: str, line: str) -> None:
    """Each example parses as ``tierflow`` would parse it (flags, choices, values): an
    example that a renamed or removed flag broke fails here, naming its file."""
    argv = shlex.split(line, comments=True)[1:]
    argv = argv[: argv.index(">")] if ">" in argv else argv
    argv = argv[:-1] if argv[-1:] == ["&"] else argv
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{name}: `{line}` is refused by the command line (exit {exc.code})")
