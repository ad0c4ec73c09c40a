"""Layering rules, checked by reading the source (no imports of the checked code).

- Nothing outside ``longshield_fx/runtime/engine.py`` reaches into the engine's private
  graph attributes (``engine.lower(...)`` is the public way to get the rewritten graph).
- Private torch APIs (``torch._*``, ``torch.testing._internal``, ``torch.ops._*``) appear in
  the package only in ``longshield_fx/_torch.py``, the adapter that lists them.
- Layers: capture -> passes -> runtime, with custom ops in ``ops/`` below both. ``passes/``
  never imports ``runtime``; ``runtime/`` imports ``passes`` only in ``engine.py`` (which
  wires them); ``ops/`` and ``capture.py`` import neither; benchmarks never import tests,
  and no test file imports another (or conftest).
- Size and purpose: no module of ``cli/`` (and ``documents.py``) over 500 lines, no function there
  over 80, and no import circle among the ``cli/`` modules.

Each checker returns ``path:line: text`` for every violation. The last test plants one
violation of each kind in a scratch tree and checks that every checker reports it.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "longshield_fx"
THIS = Path(__file__).resolve()

# Spelled in pieces so that this file's own source is no example of what it looks for.
_ENGINE_PRIVATE = re.compile(r"\.(_" + r"train|_" + r"training_graph|_" + r"inspect|_" + r"lowered)\b")
_DOTTED_TORCH = re.compile(r"\btorch(?:\.\w+)+")


def _private_torch_name(dotted: str) -> bool:
    """``torch._dynamo``, ``torch.testing._internal``, ``torch.ops._c10d_functional`` are private;
    ``torch.__version__`` and aten op names such as ``torch.ops.aten._softmax`` are not."""
    parts = dotted.split(".")
    if parts[0] != "torch":
        return False
    if parts[1:2] == ["ops"]:
        return len(parts) > 2 and parts[2].startswith("_")
    return any(p.startswith("_") and p != "__version__" for p in parts[1:])


def _py_files(root: Path, under: str) -> list[Path]:
    base = root / under
    files = [base] if base.is_file() else sorted(base.rglob("*.py"))
    return [f for f in files if f.resolve() != THIS and ".venv" not in f.parts]


def _code_lines(path: Path) -> dict[int, str]:
    """Source lines with comments and string literals (docstrings included) blanked out."""
    text = path.read_text()
    lines = text.splitlines()
    blank: dict[int, list[tuple[int, int]]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                blank.setdefault(r, []).append((c0 if r == r0 else 0, c1 if r == r1 else len(lines[r - 1])))
    out = {}
    for i, line in enumerate(lines, 1):
        chars = list(line)
        for a, b in blank.get(i, ()):
            chars[a:b] = " " * (b - a)
        out[i] = "".join(chars)
    return out


def _where(root: Path, path: Path, line: int, text: str) -> str:
    return f"{path.relative_to(root)}:{line}: {text.strip()}"


def engine_private_uses(root: Path) -> list[str]:
    """Uses of the engine's private graph attributes outside runtime/engine.py."""
    engine = root / PACKAGE / "runtime" / "engine.py"
    found = []
    for under in (PACKAGE, "benchmarks", "tests"):
        for path in _py_files(root, under):
            if path == engine:
                continue
            for i, line in _code_lines(path).items():
                if _ENGINE_PRIVATE.search(line):
                    found.append(_where(root, path, i, path.read_text().splitlines()[i - 1]))
    return found


def private_torch_uses(root: Path) -> list[str]:
    """Private torch APIs in the package outside the adapter ``_torch.py``: imports (any
    form) and dotted uses in code (not in comments or strings)."""
    adapter = root / PACKAGE / "_torch.py"
    found = []
    for path in _py_files(root, PACKAGE):
        if path == adapter:
            continue
        lines, hits = path.read_text().splitlines(), set()
        for i, line in _code_lines(path).items():
            if any(_private_torch_name(m.group(0)) for m in _DOTTED_TORCH.finditer(line)):
                hits.add(i)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if any(_private_torch_name(n) for n in names):
                hits.add(node.lineno)
        found += [_where(root, path, i, lines[i - 1]) for i in sorted(hits)]
    return found


def _imports(root: Path, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in ``path``, at any depth (function-level too).

    ``from . import x`` yields ``package.x``, so importing a subpackage by name is seen."""
    package = list(path.relative_to(root).parts[:-1])  # a module's package (an __init__'s too)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            out += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return out


# (files, forbidden module prefix, allowed files)
LAYER_RULES = [
    (f"{PACKAGE}/passes", f"{PACKAGE}.runtime", ()),
    (f"{PACKAGE}/runtime", f"{PACKAGE}.passes", (f"{PACKAGE}/runtime/engine.py",)),
    (f"{PACKAGE}/ops", f"{PACKAGE}.passes", ()),
    (f"{PACKAGE}/ops", f"{PACKAGE}.runtime", ()),
    (f"{PACKAGE}/capture.py", f"{PACKAGE}.passes", ()),
    (f"{PACKAGE}/capture.py", f"{PACKAGE}.runtime", ()),
    ("benchmarks", "tests", ()),
    ("benchmarks", "oracles", ()),
]


def imports_of_test_modules(root: Path) -> list[str]:
    """Test files importing another test file or conftest (shared code goes to conftest
    fixtures or oracles.py)."""
    found = []
    for path in _py_files(root, "tests"):
        lines = path.read_text().splitlines()
        for lineno, module in _imports(root, path):
            last = module.rsplit(".", 1)[-1]
            if last.startswith("test_") or last == "conftest":
                found.append(_where(root, path, lineno, lines[lineno - 1]))
    return sorted(set(found))


def layer_violations(root: Path) -> list[str]:
    found = []
    for under, forbidden, allowed in LAYER_RULES:
        for path in _py_files(root, under):
            if str(path.relative_to(root)) in allowed:
                continue
            lines = path.read_text().splitlines()
            for lineno, module in _imports(root, path):
                if module == forbidden or module.startswith(forbidden + "."):
                    found.append(_where(root, path, lineno, f"{lines[lineno - 1]}  (imports {forbidden})"))
    return sorted(set(found))


def required_test_dependencies(root: Path) -> set[str]:
    """Import names of what ``pip install -e '.[test]'`` always installs (the package's
    dependencies and its ``test`` extra), from pyproject.toml."""
    import tomllib

    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    specs = project.get("dependencies", []) + project.get("optional-dependencies", {}).get("test", [])
    return {re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].strip().lower().replace("-", "_") for spec in specs}


def skips_of_required_dependencies(root: Path) -> list[str]:
    """``pytest.importorskip`` of a module every test run has: such a test would be skipped,
    never failed, if the dependency went missing (a skipped required check is a defect)."""
    required, found = required_test_dependencies(root), []
    for path in _py_files(root, "tests"):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "importorskip"
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).split(".")[0].lower() in required):
                found.append(_where(root, path, node.lineno, lines[node.lineno - 1]))
    return sorted(set(found))


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80
# Folders held to one purpose per module and per function (issue 64); the rest of the package is
# being split to the same sizes.
SIZED = (f"{PACKAGE}/cli", f"{PACKAGE}/documents.py")


def oversized(root: Path, unders=SIZED) -> list[str]:
    """Modules over MAX_MODULE_LINES lines and functions over MAX_FUNCTION_LINES."""
    found = []
    for under in unders:
        for path in _py_files(root, under):
            text = path.read_text()
            if len(text.splitlines()) > MAX_MODULE_LINES:
                found.append(f"{path.relative_to(root)}: {len(text.splitlines())} lines")
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    size = node.end_lineno - node.lineno + 1
                    if size > MAX_FUNCTION_LINES:
                        found.append(f"{path.relative_to(root)}:{node.lineno}: {node.name}, {size} lines")
    return found


def import_cycles(root: Path, under: str = f"{PACKAGE}/cli") -> list[str]:
    """Cycles of imports (at any depth, function-level too) among the modules of one package,
    its ``__init__`` aside (it imports every subcommand by design)."""
    import networkx as nx

    package = under.replace("/", ".")
    graph = nx.DiGraph()
    for path in _py_files(root, under):
        if path.name == "__init__.py":
            continue
        name = f"{package}.{path.stem}"
        graph.add_node(name)
        for _, module in _imports(root, path):
            if module.startswith(package + ".") and module.count(".") == package.count(".") + 1 \
                    and not module.endswith(".__init__") and module != name:
                graph.add_edge(name, module)
    # ``from . import name`` names a module or something ``__init__`` defines: modules only
    graph.remove_nodes_from([n for n in list(graph.nodes) if not (root / (n.replace(".", "/") + ".py")).is_file()])
    return sorted(" -> ".join(sorted(cycle)) for cycle in nx.simple_cycles(graph))


def _report(found: list[str], what: str) -> str:
    return f"{len(found)} {what}:\n" + "\n".join(found)


def test_nothing_outside_the_engine_touches_its_private_graphs():
    found = engine_private_uses(REPO)
    assert not found, _report(found, "uses of the engine's private graph attributes (use engine.lower(*batch))")


def test_private_torch_apis_only_in_the_adapter():
    found = private_torch_uses(REPO)
    assert not found, _report(found, f"private torch APIs outside {PACKAGE}/_torch.py (add them there)")


def test_layers_import_downwards_only():
    found = layer_violations(REPO)
    assert not found, _report(found, "imports against the layering capture -> passes -> runtime (ops below both)")


def test_no_test_file_imports_another():
    found = imports_of_test_modules(REPO)
    assert not found, _report(found, "imports of test modules (move shared code to conftest.py or oracles.py)")


def test_no_required_test_dependency_is_imported_with_a_skip():
    found = skips_of_required_dependencies(REPO)
    assert not found, _report(found, "importorskip of a required test dependency (import it: a missing one must fail)")


def test_cli_modules_are_short_and_import_in_no_circle():
    found = oversized(REPO)
    assert not found, _report(found, f"modules over {MAX_MODULE_LINES} lines or functions over {MAX_FUNCTION_LINES}")
    cycles = import_cycles(REPO)
    assert not cycles, _report(cycles, "import circles in cli/ (move what both need into a module of its own)")


def test_the_size_and_circle_checkers_catch_planted_ones(tmp_path):
    cli = tmp_path / PACKAGE / "cli"
    cli.mkdir(parents=True)
    (cli / "__init__.py").write_text("from . import a, b\n")
    (cli / "a.py").write_text("from .b import x\n\n\ndef f():\n" + "    y = 1\n" * 80)
    (cli / "b.py").write_text("def x():\n    from .a import f\n" + "z = 0\n" * 500)
    (cli / "c.py").write_text("from . import a\n")  # imports a, no circle
    assert oversized(tmp_path) == [f"{PACKAGE}/cli/a.py:4: f, 81 lines", f"{PACKAGE}/cli/b.py: 502 lines"]
    assert import_cycles(tmp_path) == [f"{PACKAGE}.cli.a -> {PACKAGE}.cli.b"]


def test_the_checkers_catch_planted_violations(tmp_path):
    """Each checker reports a planted violation with its file and line, and accepts the
    look-alikes that are allowed (engine.py itself, torch.__version__, prose, aten ops)."""
    def plant(rel, text):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    plant(f"{PACKAGE}/runtime/engine.py", "from ..passes import lower\nself._lowered = {}\n")
    plant(f"{PACKAGE}/runtime/parallel.py", "import torch\n\n\ndef f():\n    from ..passes import clip\n")
    plant(f"{PACKAGE}/passes/clip.py", '"""mentions torch._dynamo and engine._train in prose"""\n'
          "import torch\nfrom .. import runtime\nx = torch.__version__  # torch._C in a comment\n"
          "y = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu\n")
    plant(f"{PACKAGE}/passes/bad.py", "from torch._subclasses import FakeTensorMode\nc = torch.ops._c10d_functional\n"
          "from torch.testing._internal.distributed import fake_pg\nfrom torch import _dynamo\n")
    plant(f"{PACKAGE}/_torch.py", "import torch._dynamo\n")
    plant(f"{PACKAGE}/ops/ring.py", "from ..runtime.noise import KeyStream\n")
    plant(f"{PACKAGE}/tools/plan.py", "g = engine._training_graph((ids, ids))\n")
    plant("benchmarks/overlap.py", "from tests.passes.test_shard_grads import build\nengine._inspect\n")
    plant("tests/test_x.py", "engine._train[0]\nengine._trainer  # another name\n")
    plant("tests/passes/test_y.py", "from oracles import tiny_llama\nfrom test_shard_grads import build\n"
          "import conftest\n")
    plant("pyproject.toml", '[project]\ndependencies = ["torch==2.13.0"]\n'
          '[project.optional-dependencies]\ntest = ["transformers==5.24.0", "opacus>=1.5"]\n')
    skip = "import" + "orskip"  # spelled in pieces: this file's own source is no example of it
    plant("tests/test_z.py", f'import pytest\nt = pytest.{skip}("transformers")\n'
          f'g = pytest.{skip}("graphviz")  # optional: allowed\nfrom pytest import {skip}\n'
          f'o = {skip}("opacus.layers")\n')

    assert engine_private_uses(tmp_path) == [
        f"{PACKAGE}/tools/plan.py:1: g = engine._training_graph((ids, ids))",
        "benchmarks/overlap.py:2: engine._inspect",
        "tests/test_x.py:1: engine._train[0]",
    ]
    assert private_torch_uses(tmp_path) == [
        f"{PACKAGE}/passes/bad.py:1: from torch._subclasses import FakeTensorMode",
        f"{PACKAGE}/passes/bad.py:2: c = torch.ops._c10d_functional",
        f"{PACKAGE}/passes/bad.py:3: from torch.testing._internal.distributed import fake_pg",
        f"{PACKAGE}/passes/bad.py:4: from torch import _dynamo",
    ]
    assert skips_of_required_dependencies(tmp_path) == [
        f'tests/test_z.py:2: t = pytest.{skip}("transformers")',
        f'tests/test_z.py:5: o = {skip}("opacus.layers")',
    ]
    assert imports_of_test_modules(tmp_path) == [
        "tests/passes/test_y.py:2: from test_shard_grads import build",
        "tests/passes/test_y.py:3: import conftest",
    ]
    assert layer_violations(tmp_path) == sorted([
        f"{PACKAGE}/passes/clip.py:3: from .. import runtime  (imports {PACKAGE}.runtime)",
        f"{PACKAGE}/runtime/parallel.py:5: from ..passes import clip  (imports {PACKAGE}.passes)",
        f"{PACKAGE}/ops/ring.py:1: from ..runtime.noise import KeyStream  (imports {PACKAGE}.runtime)",
        "benchmarks/overlap.py:1: from tests.passes.test_shard_grads import build  (imports tests)",
    ])
