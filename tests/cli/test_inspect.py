"""``longshield-fx inspect``: what it prints is what the engine's lowering recorded, with counts
that follow from the model; the block's graph is written as valid DOT (SVG with graphviz); with
``--cp 2`` outside torchrun it runs on a fake process group and its collectives add up."""
from __future__ import annotations

import contextlib
import io
import re
import shutil

import pytest
import torch
from torch import nn

import longshield_fx as lf
from longshield_fx import cli
from longshield_fx.cli.inspect import block_graph_module, block_nodes
from longshield_fx.models import Llama
from longshield_fx.models.llama import RMSNorm
from longshield_fx.passes import format_log

T, B = 64, 2  # inspect's -T 64 and its default physical batch


def run_inspect(*argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["inspect", *map(str, argv)]) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One inspect of the tiny Llama (seed 0, T=64) with --memory and --timeline: (stdout, --out)."""
    out = tmp_path_factory.mktemp("inspect")
    return run_inspect("-T", T, "--out", out, "--memory", "--timeline", "CPU-gloo"), out


def _model() -> nn.Module:
    torch.manual_seed(0)  # inspect's --seed 0
    return lf.CausalLMLoss(Llama.from_name("tiny"))


def test_inspect_prints_the_pipeline_and_the_log_the_engine_recorded(tiny):
    """The same model and batch lowered here give the very log inspect printed."""
    text, _ = tiny
    engine = lf.compile(_model(), config=lf.DPConfig(1.0, 1.0))
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))  # inspect's batch
    lowered = engine.lower(ids, ids)
    assert "pipeline (train): " + " -> ".join(p.__name__ for p in engine.pipelines["train"]) in text
    assert format_log(lowered.log) in text
    assert "none (cp=1" in text


def test_what_each_pass_did_follows_from_the_model(tiny):
    """Counts derived from the model's modules, not pinned: batch_dims only tags (no node
    added or removed); chunked_loss takes the LM head's matmuls into its op; per_sample turns
    each other Linear's weight-gradient mm into one einsum; the rules are linear per Linear
    but the head (lm_head_loss), sum per RMSNorm, embedding per Embedding."""
    text, _ = tiny
    modules = list(_model().modules())
    linear = sum(isinstance(m, nn.Linear) for m in modules)
    norms = sum(isinstance(m, RMSNorm) for m in modules)
    embeddings = sum(isinstance(m, nn.Embedding) for m in modules)
    before, after = map(int, re.search(r"batch_dims +(\d+) -> (\d+) nodes", text).groups())
    assert before == after
    per_sample = text[text.index("  per_sample"):text.index("  clip")]
    assert text.index("  batch_dims") < text.index("  chunked_loss") < text.index("  per_sample")
    assert f"aten.einsum.default x{linear - 1}" in per_sample.split("- ")[0]  # added
    assert f"aten.mm.default x{linear - 1}" in per_sample.split("- ")[1]  # removed
    rules = dict(re.findall(r"^  (\w+) x(\d+): ", text, flags=re.MULTILINE))
    assert rules == {"linear": str(linear - 1), "lm_head_loss": "1", "sum": str(norms),
                     "embedding": str(embeddings)}


def _dot_statements(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(node ids, edges) of our DOT text; fails on a line that is neither (a syntax check
    that needs no graphviz)."""
    lines = text.strip().splitlines()
    assert lines[0] == "digraph G {" and lines[-1] == "}"
    nodes, edges = [], []
    for line in lines[3:-1]:
        if m := re.fullmatch(r'  (n\d+) \[label="((?:[^"\\]|\\.)*)", fillcolor="#[0-9a-f]{6}", '
                             r'tooltip="((?:[^"\\]|\\.)*)"\];', line):
            nodes.append(m.group(1))
        elif m := re.fullmatch(r"  (n\d+) -> (n\d+);", line):
            edges.append(m.groups())
        else:
            raise AssertionError(f"not a DOT statement of ours: {line!r}")
    return nodes, edges


def test_the_block_graph_is_valid_dot_and_rendered_when_graphviz_is_there(tiny):
    text, out = tiny
    dot = (out / "block_layers.0.dot").read_text()
    nodes, edges = _dot_statements(dot)
    assert {a for e in edges for a in e} <= set(nodes) and len(set(nodes)) == len(nodes)
    engine = lf.compile(_model(), config=lf.DPConfig(1.0, 1.0))
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    block = block_graph_module(engine.lower(ids, ids).gm, block_nodes(engine.lower(ids, ids).gm, "layers.0"))
    assert len(nodes) == len(block.graph.nodes)
    assert len(edges) == sum(len(n.all_input_nodes) for n in block.graph.nodes)
    assert "einsum" in dot and "#d3f4d3" in dot  # the per-sample gradients a pass inserted, drawn green
    assert (out / "training_graph.py").stat().st_size > 0
    if shutil.which("dot") is None:
        assert not (out / "block_layers.0.svg").exists()
        assert f"render it with: dot -Tsvg {out / 'block_layers.0.dot'} -o {out / 'block_layers.0.svg'}" in text
    else:
        svg = (out / "block_layers.0.svg").read_text()
        assert "<svg" in svg and "einsum" in svg and "laid out by graphviz" in text


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_graphviz_lays_out_a_checkpointed_block(tmp_path):
    text = run_inspect("-T", 32, "--out", tmp_path, "--checkpoint", "block")
    svg = (tmp_path / "block_layers.0.svg").read_text()
    assert "laid out by graphviz" in text and "<svg" in svg and "einsum" in svg


def test_memory_estimate_and_timeline(tiny):
    text, out = tiny
    assert re.search(r"peak [\d.]+ MiB of intermediates at \w+", text)
    assert "largest tensors live at the peak" in text
    assert "timeline (CPU-gloo, cost model)" in text
    assert (out / "timeline.png").read_bytes().startswith(b"\x89PNG")


def test_inspect_cp2_on_a_fake_process_group_lists_collectives(tmp_path):
    import torch.distributed as dist

    out = run_inspect("--cp", 2, "-T", 64, "--out", tmp_path / "insp")
    assert not dist.is_initialized()  # the fake group is gone again
    assert "cp=2 (fake process group, one process)" in out
    assert re.search(r"context_parallel +\d+ -> +\d+", out) and re.search(r"shard_grads +\d+ -> +\d+", out)
    totals = {k: int(v.replace(",", "")) for k, v in re.findall(r"(\w+) ([\d,]+) B \(", out)}
    per_node: dict[str, int] = {}
    for op, nbytes in re.findall(r"^  \S+ +(\w+) +\S+ +([\d,]+) B$", out, flags=re.MULTILINE):
        kind = next(k for k in totals if op.startswith(k))
        per_node[kind] = per_node.get(kind, 0) + int(nbytes.replace(",", ""))
    assert totals["reduce_scatter"] > 0 and totals["ring_attention"] > 0
    assert per_node == {k: v for k, v in totals.items() if v}  # the list adds up to communication_bytes()
    assert (tmp_path / "insp" / "block_layers.0.dot").stat().st_size > 0
