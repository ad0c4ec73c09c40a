"""The README's and the docs' usage examples run as written, and the API they list is the API there is.

The text moved from one long README into the docs site (issue 37): the "Using it" example stays in
README.md; packed documents, the fine-tune recipe and the API summary live on their docs pages."""
import dataclasses
import inspect
import pathlib
import re

import pytest
import torch

import longshield_fx as lf

ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
PACKED = (ROOT / "docs" / "guides" / "packed-documents.md").read_text()
FINETUNE = (ROOT / "docs" / "guides" / "finetune.md").read_text()
GETTING_STARTED = (ROOT / "docs" / "getting-started.md").read_text()
API = (ROOT / "docs" / "reference" / "index.md").read_text()  # "API at a glance"


def test_usage_example_runs():
    example = re.search(r"## Using it\n\n```python\n(.*?)```", README, re.S).group(1)
    namespace = {}  # as written: the example defines every name it uses
    exec(compile(example, "README.md", "exec"), namespace)
    engine = namespace["engine"]
    assert engine.captures == 1
    assert 0 < engine.epsilon(delta=1e-5) < float("inf")


def test_packed_documents_example_runs():
    example = re.search(r"# Packed documents\n.*?```python\n(.*?)```", PACKED, re.S).group(1)
    namespace = {}
    exec(compile(example, "docs/guides/packed-documents.md", "exec"), namespace)
    engine, batches = namespace["engine"], namespace["batches"]
    assert 1 <= engine.captures <= 3 and batches.step == 2  # one capture per row count run: 8, 4 or 2
    assert 0 < engine.epsilon(delta=1e-5) < float("inf")


def test_documented_signatures_match():
    compile_doc = re.search(r"- `compile\((.*?)\)`", API).group(1)
    assert _names(compile_doc) == list(inspect.signature(lf.compile).parameters)
    config_doc = re.search(r"- `DPConfig\((.*?)\)`", API, re.S).group(1)
    assert _names(config_doc) == [f.name for f in dataclasses.fields(lf.DPConfig)]


def _names(params: str) -> list[str]:
    """Parameter names of a documented signature such as 'a, b=1, *, c="x"|"y"'."""
    names = []
    for part in re.split(r",\s*(?![^()\[\]]*[)\]])", params):
        name = part.strip().split("=")[0].split(":")[0].strip()
        if name and name != "*":
            names.append(name)
    return names


def test_finetune_recipe_runs(tmp_path):
    """The "Fine-tune your own model" recipe, on a model directory and documents built here."""
    import transformers
    from finetune_fixtures import documents, save, tiny_llama, tokenizer, write_folder

    texts = documents(20, seed=3)
    tok = tokenizer(texts)
    save(tiny_llama(len(tok)), tok, tmp_path / "model")
    write_folder(tmp_path / "docs", texts)
    recipe = re.search(r"# Fine-tune your own model\n.*?```python\n(.*?)```", FINETUNE, re.S).group(1)
    namespace = {"model_dir": tmp_path / "model", "data_dir": tmp_path / "docs", "out_dir": tmp_path / "out"}
    exec(compile(recipe, "docs/guides/finetune.md", "exec"), namespace)
    assert namespace["engine"].captures == 1 and namespace["train"].rows_per_unit == 4
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.randint(0, len(tok), (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, namespace["lm"].eval()(ids).logits, rtol=0, atol=0)


def test_readme_is_short_and_points_into_the_docs():
    assert len(README.splitlines()) <= 200
    for link in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / link).is_file(), link
    assert "../shared/" not in README


def test_the_docs_show_the_test_command_ci_runs():
    """`.ci/run` runs the line after README's `<!-- test-command -->` marker; Getting started shows it too."""
    command = README.split("<!-- test-command -->\n```\n", 1)[1].split("\n", 1)[0]
    assert "python -m pytest" in command and "--durations=25" in command
    assert f"```\n{command}\n```" in (ROOT / "docs" / "getting-started.md").read_text()


def _recipes() -> list[list[str]]:
    """The README's `longshield-fx train` commands after its finetune-recipes mark, as argv lists."""
    import shlex

    block = README.split("<!-- finetune-recipes -->\n```\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in block.splitlines() if line.startswith("longshield-fx train")]


# Reduced sizes: the recipes' flags as written, on a few short documents (a full run takes minutes).
_REDUCED = {"-T": "64", "--max-rows": "4", "--steps": "2", "--target-epsilon": "20"}


def test_readme_finetune_recipes_run(tmp_path):
    """Getting started's offline recipe as written (a BPE tokenizer and a small Llama saved with
    save_pretrained), on public text written here; then the README's CPU and GPU-sized recipes on
    the model it saves, at reduced sizes (the GPU one on the CPU where there is no GPU)."""
    import contextlib

    from finetune_fixtures import documents, write_folder

    from longshield_fx import cli

    recipe = re.search(r"## A model of your own, offline\n.*?```python\n(.*?)```", GETTING_STARTED, re.S).group(1)
    write_folder(tmp_path / "public-text", documents(12, seed=5))
    with contextlib.chdir(tmp_path):
        exec(compile(recipe, "docs/getting-started.md", "exec"), {"__name__": "__docs_example__"})
    write_folder(tmp_path / "my-documents", documents(24, seed=6))
    recipes = _recipes()
    assert len(recipes) == 2 and ["--device", "cuda"] == recipes[1][recipes[1].index("--device"):][:2]
    for argv in recipes:
        argv = [_REDUCED.get(before, value) for before, value in zip([""] + argv, argv)]
        argv = [a.replace("path/to/llama-3.2-1b", "my-model") for a in argv]
        if "cuda" in argv and not torch.cuda.is_available():
            argv[argv.index("cuda")] = "cpu"
        with contextlib.chdir(tmp_path):
            assert cli.main(argv) == 0, argv
        out = tmp_path / argv[argv.index("--out") + 1]
        assert (out / "model" / "config.json").is_file() and (out / "privacy.json").is_file()
