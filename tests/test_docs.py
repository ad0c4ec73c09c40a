"""The docs site (mkdocs.yml, docs/) builds strictly, its generated references are complete,
every Python example in README.md and docs/ runs as written, and no paragraph, list item or table
row is on two pages.

An example that cannot run here (a torchrun fragment, a recipe that needs your files) is marked
with a visible ``<!-- not-run: reason -->`` on the line right before its fence."""
from __future__ import annotations

import html
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import longshield_fx
from longshield_fx.cli import PROG, build_parser

ROOT = pathlib.Path(__file__).parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<indent>[ ]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
NOT_RUN = re.compile(r"^\s*<!-- not-run: (?P<reason>\S.*?) -->\s*$")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def test_mkdocs_build_strict(site):
    for page in ("index.html", "getting-started/index.html", "reference/api/index.html",
                 "reference/cli/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page


def test_api_reference_has_every_public_name(site):
    page = (site / "reference" / "api" / "index.html").read_text()
    import longshield_fx.hf
    names = [*longshield_fx.__all__, *(f"hf.{name}" for name in longshield_fx.hf.__all__)]
    missing = [name for name in names if f'id="longshield_fx.{name}"' not in page]
    assert not missing, f"not in the generated API reference: {missing}"


def _cli_sections(page: str) -> dict[str, str]:
    """Generated CLI page -> {command: the text of its section}."""
    parts = re.split(r'<h2 id="([^"]+)"', page)
    return {anchor: html.unescape(re.sub(r"<[^>]+>", "", body)) for anchor, body in zip(parts[1::2], parts[2::2])}


def test_cli_reference_has_every_flag_of_every_subcommand(site):
    sections = _cli_sections((site / "reference" / "cli" / "index.html").read_text())
    parser = build_parser()
    parsers = {PROG: parser, **{f"{PROG}-{name}": sub for name, sub in parser.commands.items()}}
    assert set(parsers) <= set(sections), sorted(set(parsers) - set(sections))
    missing = []
    for anchor, p in parsers.items():
        for action in p._actions:
            for flag in action.option_strings:
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", sections[anchor]):
                    missing.append(f"{anchor} {flag}")
    assert not missing, f"flags missing from the generated CLI reference: {missing}"


def _examples():
    """(id, code) of every python block of README.md and docs/, each distinct code once, with the
    blocks marked not-run left out."""
    seen, out = set(), []
    for path in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = path.read_text()
        lines = text.splitlines()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start())  # 0-based line of the fence
            before = next((lines[i] for i in range(line - 1, -1, -1) if lines[i].strip()), "")
            if NOT_RUN.match(before):
                continue
            code = textwrap.dedent(m.group("code"))
            if code in seen:
                continue
            seen.add(code)
            out.append(pytest.param(code, id=f"{path.relative_to(ROOT)}:{line + 1}"))
    return out


EXAMPLES = _examples()


@pytest.mark.parametrize("code", EXAMPLES)
def test_example_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs_example__"}  # a fresh namespace: the example defines every name it uses
    exec(compile(code, "<docs example>", "exec"), namespace)


def test_examples_are_found_and_not_run_marks_say_why():
    assert len(EXAMPLES) >= 3
    for path in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for line in path.read_text().splitlines():
            if "not-run" in line and line.lstrip().startswith("<!--"):
                assert NOT_RUN.match(line), f"{path}: a not-run mark needs a reason: {line!r}"


# Each fact lives on one page: a paragraph, list item or table row long enough to carry a fact
# (MIN_COPY characters) may not appear on two pages; the other page links to it instead.
MIN_COPY = 80
GENERATED = ("<!-- api-reference -->", "<!-- cli-reference -->")  # filled in by docs/hooks/generate.py
LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
LIST_ITEM = re.compile(r"([-*+]|\d+\.)\s")
TABLE_RULE = re.compile(r"[|:\-\s]+")


def _blocks(text: str) -> set[str]:
    """The paragraphs, list items and table rows of a Markdown page, outside code fences, with
    whitespace collapsed and links reduced to their text (a copy with other link targets is
    still a copy)."""
    out, current, fenced = set(), [], False

    def flush():
        if current:
            out.add(" ".join(LINK.sub(r"\1", " ".join(current)).split()))
            current.clear()

    for line in text.splitlines():
        s = line.strip()
        if s.startswith("```"):
            flush()
            fenced = not fenced
        elif fenced:
            continue
        elif not s or s.startswith(("#", "<!--")):
            flush()
        elif s.startswith("|"):
            flush()
            if not TABLE_RULE.fullmatch(s):
                out.add(" ".join(LINK.sub(r"\1", s).split()))
        else:
            if LIST_ITEM.match(s):
                flush()
            current.append(s)
    flush()
    return out


def _copies(pages: dict[str, str]) -> list[str]:
    """Blocks of at least MIN_COPY characters found on two or more of ``pages`` (name -> text)."""
    where: dict[str, list[str]] = {}
    for name, text in pages.items():
        for block in _blocks(text):
            if len(block) >= MIN_COPY:
                where.setdefault(block, []).append(name)
    return [f"{' and '.join(names)}: {block[:120]}" for block, names in where.items() if len(names) > 1]


def test_the_copy_check_sees_a_copied_paragraph_list_item_and_table_row():
    para = "A paragraph long enough to carry a fact, wrapped over\ntwo lines, with a [link](a.md) in it."
    item = "- A list item long enough to carry a fact of its own, which another page repeats."
    row = "| a table row | long enough | to carry a measured number, 12.5 ms | and its unit |"
    one = f"# One\n\n{para}\n\n{item}\n\n| h | h | h | h |\n|---|---|---|---|\n{row}\n\n```\n{para}\n```\n"
    other = f"# Other\n\n{' '.join(para.split()).replace('(a.md)', '(../b.md)')}\n\n{item}\n\n{row}\n"
    assert len(_copies({"one": one, "other": other})) == 3
    assert _copies({"one": one, "other": "# Other\n\nSee [one](one.md).\n"}) == []


def test_no_paragraph_list_item_or_table_row_is_on_two_pages():
    pages = {}
    for path in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = path.read_text()
        if not any(marker in text for marker in GENERATED):
            pages[str(path.relative_to(ROOT))] = text
    copies = _copies(pages)
    assert not copies, "keep each on one page and link to it from the others:\n" + "\n".join(copies)
