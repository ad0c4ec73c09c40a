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


def test_a_checkpointed_block_is_laid_out_by_graphviz_or_named_for_it(tmp_path):
    text = run_inspect("-T", 32, "--out", tmp_path, "--checkpoint", "block")
    dot = tmp_path / "block_layers.0.dot"
    assert "einsum" in dot.read_text()
    if shutil.which("dot") is None:  # graphviz is optional: the DOT file and how to render it
        assert f"render it with: dot -Tsvg {dot} -o {tmp_path / 'block_layers.0.svg'}" in text
    else:
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


def _timeline_ms(text: str, hardware: str) -> tuple[str, str, str]:
    """(step, communication, exposed) as inspect printed them, in ms."""
    m = re.search(rf"timeline \({hardware}, cost model\): step ([\d.]+) ms, communication ([\d.]+) ms of which "
                  r"exposed ([\d.]+) ms", text)
    assert m, text[-2000:]
    return m.groups()


def _simulated_ms(mesh, layout, hardware: str, **compile_kw) -> tuple[str, str, str]:
    """The same tiny model and batch as inspect's, lowered here, on the cost model with ``layout``."""
    from longshield_fx.tools.cost_model import HARDWARE, simulate

    engine = lf.compile(_model(), mesh, config=lf.DPConfig(1.0, 1.0), **compile_kw)
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    tl = simulate(engine.lower(ids, ids).gm, HARDWARE[hardware], layout)
    return f"{tl.total * 1e3:.3f}", f"{tl.comm * 1e3:.3f}", f"{tl.exposed_comm * 1e3:.3f}"


def test_inspect_2d_attention_on_two_nodes_shows_all_to_alls_and_their_timeline(tmp_path, fake_world):
    """--cp 2 --hp 2 on a fake process group of 4 ranks: per layer four all-to-alls forward and
    four backward listed with their bytes, adding up to communication_bytes(); the timeline on
    2 nodes x 4 GPUs is the cost model's for the hp=2 x cp=2 head-first layout."""
    from longshield_fx.tools.cost_model import SequenceLayout

    out = run_inspect("--cp", 2, "--hp", 2, "-T", T, "--out", tmp_path, "--timeline", "2x4-H100-IB")
    assert "cp=2 x hp=2 (fake process group, one process)" in out
    layers = Llama.from_name("tiny").cfg.n_layers
    rows = re.findall(r"^  \S+ +(\w+) +\S+ +([\d,]+) B$", out, flags=re.MULTILINE)
    a2a = [int(n.replace(",", "")) for op, n in rows if op == "all_to_all_single"]
    assert len(a2a) == 8 * layers and all(n > 0 for n in a2a)
    totals = {k: int(v.replace(",", "")) for k, v in re.findall(r"(\w+) ([\d,]+) B \(", out)}
    assert sum(a2a) == totals["all_to_all"] and totals["ring_attention"] > 0
    with fake_world(2, hp=2) as mesh:
        expected = _simulated_ms(mesh, SequenceLayout(2, 2), "2x4-H100-IB")
    assert _timeline_ms(out, "2x4-H100-IB") == expected
    assert float(expected[1]) > 0  # the all-to-alls and the rest take time on the communication lane
    assert (tmp_path / "timeline.png").read_bytes().startswith(b"\x89PNG")


def test_inspect_double_ring_passes_its_inner_ring_to_the_graph_and_the_timeline(tmp_path, fake_world):
    """--cp 4 --inner-ring 2: the header says so, the ring ops carry w=2, and the timeline is the
    cost model's for the double ring (cp=4 in inner rings of 2)."""
    from longshield_fx.tools.cost_model import SequenceLayout

    out = run_inspect("--cp", 4, "--inner-ring", 2, "-T", T, "--out", tmp_path, "--timeline", "H100-IB")
    assert "cp=4, inner ring 2 (fake process group, one process)" in out
    code = (tmp_path / "training_graph.py").read_text()
    rings = re.findall(r"torch\.ops\.longshield\.ring_attention(?:_backward)?\.default\((.*)\)", code)
    assert len(rings) == 2 * Llama.from_name("tiny").cfg.n_layers
    assert all(args.endswith(", 4, 2") for args in rings)  # cp, inner ring
    with fake_world(4) as mesh:
        expected = _simulated_ms(mesh, SequenceLayout(1, 4, 2), "H100-IB", inner_ring=2)
        one_ring = _simulated_ms(mesh, SequenceLayout(1, 4), "H100-IB")
    assert _timeline_ms(out, "H100-IB") == expected != one_ring


def test_inspect_packed_lowers_a_batch_of_the_rows_asked_for(tmp_path):
    """The random documents fill the --physical-batch-size rows (train's first batches are full):
    each parameter's method is the one an engine picks for a batch of 8 rows (the cost model's
    words name the rows: 4 units a row)."""
    from longshield_fx.packing import empty_batch, unit_slots_for

    text = run_inspect("-T", T, "--packed", "--physical-batch-size", 8, "--out", tmp_path)
    U = unit_slots_for(8, T, 8)
    engine = lf.compile(lf.PackedCausalLMLoss(_model().lm), config=lf.DPConfig(1.0, 1.0), packed_units=U)
    methods = engine.lower(*empty_batch(8, T, U).tensors()).norm_methods
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  lm.")}
    assert any("32 units" in m for m in methods.values())
    for name, method in methods.items():
        assert lines[name].endswith(method), (name, method)


def test_inspect_packed_shows_the_unit_slots_and_each_parameters_per_unit_method(tmp_path, capsys):
    """--packed lowers the graph `train --data` runs: its unit slots per row, and per parameter the
    norm method the packed engine picks for those shapes (the unit slots are its samples); with
    --cp 2, the ring attention and the per-unit-slot gradients reduce-scattered over cp."""
    from longshield_fx.packing import empty_batch, unit_slots_for

    text = run_inspect("-T", T, "--packed", "--out", tmp_path)
    U = unit_slots_for(B, T, 8)  # train's unit slots at its default --expected-batch-size
    assert U < unit_slots_for(B, T)
    assert f"packed documents: {U} unit slots per physical batch" in text
    engine = lf.compile(lf.PackedCausalLMLoss(_model().lm), config=lf.DPConfig(1.0, 1.0), packed_units=U)
    methods = engine.lower(*empty_batch(B, T, U).tensors()).norm_methods
    assert any(m.startswith("ghost") for m in methods.values()) and any(m.startswith("per-sample")
                                                                         for m in methods.values())
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  lm.")}
    for name, method in methods.items():
        assert lines[name].endswith(method), (name, method)
    text = run_inspect("-T", T, "--packed", "--cp", "2", "--out", tmp_path)
    assert "cp=2 (fake process group, one process)" in text and f"packed documents: {U} unit slots" in text
    collectives = [line.split() for line in text.splitlines() if line.startswith("  ") and "B" == line.split()[-1]]
    assert sum(c[1] == "ring_attention" for c in collectives) == 2  # one per layer
    scattered = [c[2] for c in collectives if c[1] == "reduce_scatter_tensor"]
    assert scattered and all(f",{U + 1}," in shape for shape in scattered), scattered  # (.., U+1 slots, ..)
    assert cli.main(["inspect", "-T", str(T), "--packed", "--hp", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not hp yet" in err[0], err
