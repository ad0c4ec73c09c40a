"""mkdocs hook: pages generated at build time, never copied by hand.

* ``<!-- api-reference -->`` becomes one mkdocstrings block per name in ``longshield_fx.__all__``,
  then one per name in ``longshield_fx.hf.__all__``.
* ``<!-- cli-reference -->`` becomes the ``--help`` of ``longshield-fx`` and of every subcommand,
  rendered from the argparse parsers that ``longshield_fx.cli.build_parser()`` builds.
* ``benchmarks/results/*`` (full benchmark outputs, plots) are published under ``results/``.
"""
from __future__ import annotations

import os
import pathlib

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def on_files(files, config):
    for path in sorted(RESULTS.iterdir()):
        if path.is_file():
            files.append(File(f"results/{path.name}", src_dir=str(RESULTS.parent), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files


def api_markdown() -> str:
    import longshield_fx

    return "\n\n".join([*(f"::: longshield_fx.{name}" for name in longshield_fx.__all__),
                        "## Hugging Face Trainer: `longshield_fx.hf`", *_hf_blocks()]) + "\n\n"


def _hf_blocks() -> list[str]:
    """One block per name of ``longshield_fx.hf.__all__``, read from the package's
    ``__init__.py`` (importing it imports transformers); a name it imports is rendered from its
    module. A class made on first access (``DPSFTTrainer``, which needs trl) is
    not visible to mkdocstrings: its heading and docstring are written out here."""
    import ast

    import longshield_fx

    tree = ast.parse((pathlib.Path(longshield_fx.__file__).parent / "hf" / "__init__.py").read_text())
    names = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "__all__" for t in node.targets))
    top = {node.name for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    top |= {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    nested = {node.name: ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    return [f"::: longshield_fx.hf.{name}" if name in top else
            f"## `longshield_fx.hf.{name}` {{#longshield_fx.hf.{name}}}\n\n{nested[name]}" for name in names]


def cli_help() -> list[tuple[str, str]]:
    """(command, its --help text) for ``longshield-fx`` and each subcommand."""
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; fix it so builds are reproducible
    from longshield_fx.cli import PROG, build_parser

    parser = build_parser()
    out = [(PROG, parser.format_help())]
    for name, sub in parser.commands.items():
        out.append((f"{PROG} {name}", sub.format_help()))
    return out


def cli_markdown() -> str:
    parts = []
    for command, text in cli_help():
        parts.append(f"## `{command}`\n\n```text\n{text.rstrip()}\n```")
    return "\n\n".join(parts)


def on_page_markdown(markdown, page, config, files):
    if "<!-- api-reference -->" in markdown:
        markdown = markdown.replace("<!-- api-reference -->", api_markdown())
    if "<!-- cli-reference -->" in markdown:
        markdown = markdown.replace("<!-- cli-reference -->", cli_markdown())
    return markdown
