"""``longshield-fx inspect``: build the training graph for one batch (``engine.lower``, no step
is run) and show what the passes did: the pipeline, node counts and ops added/removed per pass,
the per-sample rule of every parameter, the inserted collectives and their bytes; write one
transformer block's rewritten graph (graphviz DOT, and SVG when graphviz is installed) and the
whole graph's code."""
from __future__ import annotations

import contextlib
import re
import types
from pathlib import Path

import torch
from torch import fx

from .common import EXPECTED_BATCH_SIZE, CLIError, Formatter, add_model_args, check_seq_len, positive_float, \
    positive_int, rank, say, setup_distributed, under_torchrun
from .models import build_model, check_model_flags

DESCRIPTION = (
    "Build the training graph for one (random) batch without training and print: the pass pipeline,\n"
    "node counts before/after each pass and the ops it added and removed, the per-sample rule of every\n"
    "parameter, and the collectives the passes inserted with their bytes per physical batch. Writes the\n"
    "rewritten graph of one transformer block as graphviz DOT (and SVG when graphviz's dot program is\n"
    "installed), and the whole graph's code, to --out.\n\n"
    "--cp N > 1 outside torchrun uses a fake process group of N ranks in this one process\n"
    "(shapes and collectives are real, nothing is sent).\n\n"
    "--packed shows the graph `train --data` runs by default: the rows hold packed documents and\n"
    "the samples are unit slots (docs/guides/packed-documents.md).")


def add_parser(sub) -> None:
    from ..tools.cost_model import HARDWARE

    i = sub.add_parser("inspect", formatter_class=Formatter, description=DESCRIPTION,
                       help="show what the passes did to the training graph; draw one block")
    add_model_args(i, seq_len_default=256)
    i.set_defaults(physical_batch_size=2, func=inspect)
    i.add_argument("--block", default="layers.0", metavar="PATH",
                   help="module path of the block to draw (matched as a dotted component sequence)")
    i.add_argument("--out", default="runs/inspect", metavar="DIR", help="where the graph files go")
    i.add_argument("--memory", action="store_true",
                   help="print the liveness memory estimate of the training graph (peak and the tensors making it)")
    i.add_argument("--hp", type=positive_int, default=1, metavar="N",
                   help="head-parallel degree (2D attention over hp x cp ranks; fake process group only)")
    i.add_argument("--inner-ring", type=positive_int, default=None, metavar="W",
                   help="double-ring attention: inner rings of W cp ranks (default: one ring)")
    i.add_argument("--packed", action="store_true",
                   help="packed documents, each unit its own privacy unit: the graph `train --data` runs (on one "
                   "process or on each data-parallel rank) for physical batches of --physical-batch-size rows (train "
                   "prints its own: 'packed into physical batches of N rows') and its unit slots for "
                   "--expected-batch-size")
    i.add_argument("--expected-batch-size", type=positive_float, default=EXPECTED_BATCH_SIZE, metavar="E",
                   help="with --packed: train's expected units per logical batch, which bound its unit slots "
                   "(packing.unit_slots_for); the default is train's")
    i.add_argument("--timeline", choices=list(HARDWARE), nargs="?", const="H100-NVLink", default=None,
                   help="draw the cost-model compute/communication timeline for this hardware to timeline.png in "
                   "--out and print the exposed communication (default: none; the flag alone: H100-NVLink)")


# --- graph pieces -------------------------------------------------------------------------------

def is_collective(node) -> bool:
    t = str(node.target)
    return node.op == "call_function" and (
        (t.startswith("_c10d_functional.") and "wait_tensor" not in t) or t.startswith("longshield.ring_attention"))


def collective_bytes(engine, node) -> int:
    """Bytes one collective node moves, by ``Engine.communication_bytes``'s own convention: the
    engine's counter is run on a one-node graph holding just this node (and its inputs' metadata)."""
    g = fx.Graph()
    env = {}
    for a in node.all_input_nodes:
        env[a] = g.placeholder(a.name)
        env[a].meta = dict(a.meta)
    g.node_copy(node, lambda a: env[a])
    return sum(engine.parallel.communication_bytes(types.SimpleNamespace(graph=g), engine._group_ranks()).values())


def _block_pattern(block: str):
    return re.compile(r"(^|[.\]'\[])" + re.escape(block).replace(r"\.", r"(\.|\[)") + r"($|[.\]])")


def block_nodes(gm, block: str) -> list:
    """Nodes of the block at module path ``block``: forward nodes by ``nn_module_stack``, backward
    ones by ``fwd_nn_module_stack``, plus nodes a pass inserted (no module metadata) whose inputs
    all come from the block (or are graph inputs), e.g. the block's per-sample einsums and norms."""
    pat = _block_pattern(block)
    chosen: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack")
        if stack:
            if any(pat.search(str(v[0])) for v in stack.values()):
                chosen[n] = None
        else:
            ins = n.all_input_nodes
            if any(a in chosen for a in ins) and all(a in chosen or a.op == "placeholder" for a in ins):
                chosen[n] = None
    return list(chosen)


def block_graph_module(gm, nodes):
    """A stand-alone GraphModule of ``nodes``: outside inputs become placeholders, values used
    outside become outputs."""
    chosen = set(nodes)
    g = fx.Graph()
    env = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in chosen and a not in env:
                env[a] = g.placeholder(a.name)
                env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    outs = [env[n] for n in nodes if any(u not in chosen for u in n.users)]
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


# --- the report -----------------------------------------------------------------------------------

def _collapse(names: list[str]) -> list[str]:
    """Parameter names with layer indices replaced by '*', deduplicated, in first-seen order."""
    seen = {}
    for n in names:
        seen.setdefault(re.sub(r"\.\d+\.", ".*.", n), None)
    return list(seen)


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _rules_section(engine, lowered, cp: int) -> list[str]:
    lines = ["per-sample rules:"]
    by_rule: dict[str, list[str]] = {}
    for name, rule in lowered.rules.items():
        by_rule.setdefault(str(rule), []).append(name)
    for rule, names in sorted(by_rule.items()):
        lines.append(f"  {rule} x{len(names)}: {', '.join(_collapse(names))}")
    lines.append("per parameter (rule, shape, cp-shard dim of its clipped sum, norm and clipped sum by):")
    shapes = {n: tuple(p.shape) for n, p in engine.model.named_parameters()}
    width = max(map(len, lowered.rules), default=0)
    for name, rule in lowered.rules.items():
        shard = lowered.shard_dims.get(name)
        where = "-" if cp == 1 else ("replicated" if shard is None else f"dim {shard}")
        lines.append(f"  {name:<{width}}  {rule:<10} {list(shapes.get(name, ()))!s:<14} {where:<10} "
                     f"{lowered.norm_methods[name]}")
    return lines


def _collectives_section(engine, lowered, cp: int, dp: int) -> list[str]:
    lines = ["collectives in the graph (bytes per physical batch):"]
    colls = [n for n in lowered.gm.graph.nodes if is_collective(n)]
    if not colls:
        lines.append("  none (cp=1: the graph runs in one process)")
    else:
        totals = engine.communication_bytes()
        lines.append("  totals: " + ", ".join(f"{k} {v:,} B ({_fmt_bytes(v)})" for k, v in totals.items()))
        for n in colls:
            v = next((a.meta.get("val") for a in n.args if isinstance(a, fx.Node)), None)
            shape = (f"{str(v.dtype).replace('torch.', '')}[{','.join(map(str, v.shape))}]"
                     if isinstance(v, torch.Tensor) else "?")
            lines.append(f"  {n.name:<42} {str(n.target).split('.')[1]:<28} {shape:<22} "
                         f"{collective_bytes(engine, n):>10,} B")
    outside = []
    if cp > 1:
        gathered = sum(p.numel() * 4 for n, p in engine.model.named_parameters()
                       if lowered.shard_dims.get(n) is not None)
        outside.append(f"all_gather of the cp-sharded clipped sums ({_fmt_bytes(gathered)} fp32 gathered)")
    if dp > 1:
        full = sum(p.numel() * 4 for p in engine.model.parameters())
        outside.append(f"all_reduce over dp of the full clipped sums ({_fmt_bytes(full)})")
    if outside:
        lines.append("outside the graph, once per logical batch (finalize): " + "; ".join(outside))
    return lines


def inspect_report(engine, lowered, *, header: str, cp: int, dp: int) -> str:
    """What ``inspect`` prints: the pipeline and the passes' log as ``print(engine)`` shows them,
    the per-sample rules, the collectives."""
    from ..passes import format_log

    lines = [header, "pipeline (train): " + " -> ".join(lowered.passes),
             "passes (graph nodes before -> after; ops added +, removed -):", format_log(lowered.log)]
    lines += _rules_section(engine, lowered, cp)
    lines += _collectives_section(engine, lowered, cp, dp)
    return "\n".join(lines)


# --- the command ----------------------------------------------------------------------------------

def _lower(args, stack: contextlib.ExitStack):
    """(engine, lowered, dp, header, model name): the training graph of one random batch, on a
    fake process group of --cp ranks outside torchrun (the group lives as long as ``stack``)."""
    import longshield_fx as lf

    from .._torch import fake_world

    fake = args.cp * args.hp > 1 and not under_torchrun()
    if fake:
        mesh, dp = stack.enter_context(fake_world(args.cp, hp=args.hp)), 1
    elif args.hp > 1:
        raise CLIError("inspect --hp builds the graph on a fake process group: run it without torchrun")
    else:
        mesh, dp, _ = setup_distributed(args.cp, "cpu", "inspect")
    model, _, model_name = build_model(args)
    config = lf.DPConfig(args.max_grad_norm, 1.0, clipping=args.clipping)  # graph only: no noise drawn
    checkpoint = None if args.checkpoint == "none" else args.checkpoint
    ids = torch.randint(0, 256, (args.physical_batch_size, args.seq_len),
                        generator=torch.Generator().manual_seed(args.seed))
    if args.packed:
        engine, lowered, slots = _lower_packed(args, model, mesh, config, checkpoint, ids)
    else:
        engine = lf.compile(model, mesh, config=config, checkpoint=checkpoint, inner_ring=args.inner_ring)
        lowered, slots = engine.lower(ids, ids), ""
    where = (f"cp={args.cp}" + (f" x hp={args.hp}" if args.hp > 1 else "")
             + (f", inner ring {args.inner_ring}" if args.inner_ring else "")
             + (" (fake process group, one process)" if fake else "") + (f", dp={dp}" if dp > 1 else ""))
    header = (f"{model_name}: {sum(p.numel() for p in model.parameters()):,} parameters; batch "
              f"({args.physical_batch_size}, {args.seq_len}); {where}; checkpointing {args.checkpoint}; "
              f"{args.clipping} clipping{slots}")
    return engine, lowered, dp, header, model_name


def _lower_packed(args, model, mesh, config, checkpoint, ids):
    """The packed-documents graph of ``train --data`` for rows of random documents: (engine,
    lowered, the header's words on the unit slots)."""
    import longshield_fx as lf

    from ..losses import packing_refused
    from ..packing import pack_documents, unit_slots_for

    if args.hp > 1:
        raise CLIError("inspect --packed: packed documents run over cp and dp, not hp yet; drop --hp")
    if args.physical_batch_size < 2:
        raise CLIError("inspect --packed: a packed batch has at least 2 rows; set --physical-batch-size 2 or more")
    why = packing_refused(model.lm)
    if why:
        raise CLIError(f"inspect --packed: {why}")
    rows, T = ids.shape
    U = unit_slots_for(rows, T, args.expected_batch_size)
    engine = lf.compile(lf.PackedCausalLMLoss(model.lm), mesh, config=config, checkpoint=checkpoint,
                        packed_units=U, inner_ring=args.inner_ring)
    # U documents (a unit each) cut at random from the random rows, all their tokens: enough to
    # fill a batch of the rows asked for, as train's first batches are
    flat = ids.flatten().tolist()
    g = torch.Generator().manual_seed(args.seed)
    cuts = (torch.randperm(len(flat) // 2 - 1, generator=g)[:U - 1] + 1).mul(2).sort().values.tolist()
    units = [[flat[a:b]] for a, b in zip([0, *cuts], [*cuts, len(flat)])]  # each at least 2 tokens
    (batch, *_), _ = pack_documents(units, seq_len=T, rows=rows, unit_slots=U)
    assert batch.input_ids.shape[0] == rows, (batch.input_ids.shape, rows)
    lowered = engine.lower(*batch.tensors())
    return engine, lowered, (f"; packed documents: {U} unit slots per physical batch (the samples; slot {U} holds "
                             f"the padding and is never counted), {len(batch.members)} of them filled here")


def _write_files(args, lowered, model_name: str) -> None:
    """Rank 0: the block's graph (DOT, SVG with graphviz), the whole graph's code, the timeline."""
    from ..tools.plots import write_graph

    gm, out = lowered.gm, Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "training_graph.py").write_text(gm.code)
    nodes = block_nodes(gm, args.block)
    if not nodes:
        raise CLIError(f"--block {args.block!r}: no graph node comes from a module at that path")
    kinds = {"forward": 0, "backward": 0, "inserted": 0}
    for n in nodes:
        kinds["forward" if n.meta.get("nn_module_stack") else
              "backward" if n.meta.get("fwd_nn_module_stack") else "inserted"] += 1
    files = write_graph(block_graph_module(gm, nodes), out / f"block_{args.block.replace('/', '_')}",
                        title=f"{model_name}: {args.block} (rewritten)")
    if args.timeline:
        _timeline(args, gm, out, model_name)
    say(f"block {args.block}: {len(nodes)} nodes ({kinds['forward']} forward, {kinds['backward']} backward, "
        f"{kinds['inserted']} inserted by passes) -> {files.describe()}; whole graph code -> "
        f"{out / 'training_graph.py'}")


def _timeline(args, gm, out: Path, model_name: str) -> None:
    from ..tools.cost_model import HARDWARE, SequenceLayout, draw_timeline, simulate

    timeline = simulate(gm, HARDWARE[args.timeline], SequenceLayout(args.hp, args.cp, args.inner_ring or 0))
    draw_timeline(timeline, str(out / "timeline.png"), f"{model_name}, cp={args.cp}, hp={args.hp}, {args.timeline}: exposed "
                  f"communication {timeline.exposed_comm * 1e3:.3f} of {timeline.comm * 1e3:.3f} ms")
    say(f"timeline ({args.timeline}, cost model): step {timeline.total * 1e3:.3f} ms, communication "
        f"{timeline.comm * 1e3:.3f} ms of which exposed {timeline.exposed_comm * 1e3:.3f} ms -> {out / 'timeline.png'}")


def inspect(args) -> int:
    check_seq_len(args)
    check_model_flags(args)
    with contextlib.ExitStack() as stack:
        engine, lowered, dp, header, model_name = _lower(args, stack)
        say(inspect_report(engine, lowered, header=header, cp=args.cp, dp=dp))
        if args.memory:
            from ..tools.memory import estimate_memory

            say(estimate_memory(lowered.gm).format())
        if rank() == 0:
            _write_files(args, lowered, model_name)
    return 0
