"""The documentation against the code and against itself (datasette's docs meta-tests).

- docs/cli.md is what ``scripts/cli_docs.py`` makes of the argument parsers;
- the README fits on a screen or two and keeps the two commands of a fresh machine;
- each guide in docs/ says how to do one thing in at most 400 lines (figures live in the
  results logs beside the benchmarks, benchmarks/*/README.md);
- every benchmark script is in the index, benchmarks/README.md;
- every relative link of the README, docs/ and benchmarks/ leads to a file, and its #anchor
  to a heading of that file; every repository path written in backticks exists.
"""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 200
GUIDE_MAX_LINES = 400
#: Pages generated from the code: references, not guides (no length limit).
GENERATED = {"docs/cli.md": ".venv/bin/python scripts/cli_docs.py",
             "docs/recipe-reference.md": ".venv/bin/python -m octfw.recipe.reference > docs/recipe-reference.md"}
FRESH_MACHINE_COMMANDS = ("./scripts/setup.sh && .venv/bin/octfw run recipes/quickstart.toml",
                          "./scripts/test.sh")


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").rglob("README.md"))]


def _cli_docs():
    spec = importlib.util.spec_from_file_location("cli_docs", ROOT / "scripts" / "cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- docs/cli.md and the parsers ----------------------------------------------------------


def test_the_command_reference_is_what_the_parsers_say():
    expected = _cli_docs().render()
    written = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert written == expected, (
        "docs/cli.md differs from octfw's argument parsers (a command or its help changed); "
        f"rewrite it with: {GENERATED['docs/cli.md']}")


def test_the_command_reference_documents_every_argument_of_every_command():
    from octfw.cli.main import build_parser

    cli_docs = _cli_docs()
    page = cli_docs.render()
    commands, _ = cli_docs._subcommands(build_parser())
    assert [name for name, _, _ in commands][:4] == ["run", "check", "show", "list"]
    for name, _, parser in commands:
        section = page.split(f"\n## octfw {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in section or f", {option}" in section, (name, option)


def test_the_readme_lists_every_command():
    from octfw.cli.main import build_parser

    commands, _ = _cli_docs()._subcommands(build_parser())
    text = README.read_text(encoding="utf-8")
    missing = [name for name, _, _ in commands if not re.search(rf"^\| `octfw {re.escape(name)}\b", text, re.M)]
    assert not missing, f"README.md's command list has no line for: {', '.join(missing)}"


# --- sizes ---------------------------------------------------------------------------------


def test_the_readme_fits_on_a_screen_or_two():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into a guide in docs/ "
        "or a figure into a results log beside its benchmark, and link it")


def test_each_guide_is_at_most_400_lines():
    long = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        name = page.relative_to(ROOT).as_posix()
        lines = page.read_text(encoding="utf-8").count("\n")
        if name not in GENERATED and lines > GUIDE_MAX_LINES:
            long[name] = lines
    assert not long, (f"guides over {GUIDE_MAX_LINES} lines: {long}; a guide says how to do one thing and why: "
                      "split it, or move measurements into the results log beside their benchmark")


def test_the_readme_keeps_the_two_commands_of_a_fresh_machine():
    """.ci/run runs the second; a newcomer runs both as written."""
    lines = [line.split("#", 1)[0].strip() for line in README.read_text(encoding="utf-8").splitlines()]
    for command in FRESH_MACHINE_COMMANDS:
        assert command in lines, f"README.md lost the command {command!r}"


# --- benchmarks ----------------------------------------------------------------------------


def test_every_benchmark_script_is_in_the_index_with_its_command():
    index = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    scripts = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks").glob("*/*.py")
                     if not p.name.startswith("_"))
    assert scripts, "no benchmark scripts found"
    missing = [s for s in scripts if f"python {s}" not in index]
    assert not missing, f"benchmarks/README.md gives no command for: {', '.join(missing)}"
    groups = sorted({Path(s).parent.name for s in scripts})
    logs = [g for g in groups if not (ROOT / "benchmarks" / g / "README.md").exists()]
    assert not logs, f"benchmark groups without a results log (benchmarks/<group>/README.md): {logs}"


# --- links and paths -----------------------------------------------------------------------

_LINK = re.compile(r"(?<!\!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]+`")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).replace("`", "").strip().lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        anchors.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return anchors


def _prose(page: Path) -> str:
    return _FENCE.sub("", page.read_text(encoding="utf-8"))


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_leads_to_a_file_and_a_heading(page):
    problems = []
    for target in _LINK.findall(_CODE_SPAN.sub("", _prose(page))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            problems.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            problems.append(f"{target}: no heading with the anchor #{anchor} in {linked.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


_REPO_PATH = re.compile(r"`((?:benchmarks|docs|recipes|scripts|tests|examples|octfw)/[\w./-]+)`")
#: A name that stands for others (`recipes/step_N.toml` in a run folder), not a file of the repository.
_PLACEHOLDER = re.compile(r"(?:^|[/_])(?!README\b)[A-Z]+(?=[._/]|$)")


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_repository_path_in_backticks_exists(page):
    """A moved benchmark or results file leaves no stale path behind (globs and placeholders aside)."""
    missing = sorted({path for path in _REPO_PATH.findall(page.read_text(encoding="utf-8"))
                      if not _PLACEHOLDER.search(path) and not (ROOT / path).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"
