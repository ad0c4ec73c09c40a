"""``longshield-fx plan``: the longest context that fits on N GPUs, from the rewritten graph
built on fake tensors (``longshield_fx.tools.plan``); ``--table`` writes the comparison with
the paper's tables (``longshield_fx.tools.paper_tables``)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .common import CLIError, Formatter, nonneg_float, positive_float, positive_int


def add_parser(sub) -> None:
    from ..tools.cost_model import HARDWARE
    from ..tools.plan import DEFAULT_OVERHEAD_GIB, DTYPES, MODELS
    from ..tools.plan_graphs import default_cache_dir

    p = sub.add_parser(
        "plan", formatter_class=Formatter, help="predict the longest context that fits on N GPUs",
        description="Longest power-of-two context per GPU for DP training with longshield_fx (cp layout) and "
                    "for an FSDP-style layout, from the rewritten graph built on fake tensors.")
    p.set_defaults(func=plan)
    p.add_argument("--model", metavar="NAME|DIR",
                   help=f"one of {', '.join(MODELS)}, or a local Hugging Face model directory (only its config.json "
                   "is read: the plan needs shapes, never weights) (default: none; required unless --table or "
                   "--hf-config)")
    p.add_argument("--hf-config", metavar="PATH", default=None,
                   help="plan a Hugging Face causal LM of any architecture from this config JSON instead of --model "
                   "(default: none)")
    p.add_argument("--gpus", type=positive_int, help="number of GPUs N (model states shard over all) "
                   "(default: none; required unless --table)")
    p.add_argument("--gpu-mem-gb", type=positive_float, help="memory per GPU in GiB (80 for an 80 GB H100) "
                   "(default: none; required unless --table, where it is 80)")
    p.add_argument("--cp", type=positive_int, default=None,
                   help="context-parallel (ring) degree (default: --gpus / --hp)")
    p.add_argument("--hp", type=positive_int, default=1,
                   help="head-parallel degree: 2D attention over hp x cp ranks (LoongTrain)")
    p.add_argument("--search-attention", metavar="CLUSTER", default=None,
                   choices=list(HARDWARE),
                   help="also rank every (hp, cp, inner ring w, placement) of --gpus sequence-parallel ranks by the "
                        "cost model's attention time on CLUSTER, at --seq-len or the DP layout's longest T "
                        "(default: none)")
    p.add_argument("--checkpoint", choices=["block", "selective"], default=None,
                   help="activation checkpointing of the DP layout (default: none)")
    p.add_argument("--mbs", type=positive_int, default=1, help="micro-batch size (samples per GPU per step)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute dtype")
    p.add_argument("--overhead-gb", type=nonneg_float, default=DEFAULT_OVERHEAD_GIB,
                   help="fixed GiB per GPU for the CUDA context, workspaces and fragmentation")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="also print the breakdown at this T (default: none)")
    p.add_argument("--table", metavar="PATH", default=None,
                   help="instead: write the predictions next to longshield.md Tables 2, 4, 5 (4 x --gpu-mem-gb) "
                        "as markdown to PATH (default: none)")
    p.add_argument("--cache-dir", default=str(default_cache_dir()),
                   help="where graph timelines are cached (keyed by a hash of the sources); '' disables")
    p.add_argument("--jobs", type=positive_int, default=min(4, os.cpu_count() or 1),
                   help="graph captures run at once, each in its own process")


def _request(args) -> int:
    """The cp degree; refuses a request the planner cannot answer."""
    from ..tools.plan import PlanError, check_args

    missing = [f"--{n.replace('_', '-')}" for n in ("gpus", "gpu_mem_gb") if getattr(args, n) is None]
    if args.model is None and args.hf_config is None:
        missing.insert(0, "--model")
    if missing:
        raise CLIError(f"the following arguments are required: {', '.join(missing)}")
    if args.model is not None and args.hf_config is not None:
        raise CLIError("--model and --hf-config both name the model: pass one")
    args.model = _model(args)
    cp = args.gpus // args.hp if args.cp is None else args.cp
    try:
        check_args(args.model, args.gpus, args.gpu_mem_gb, cp, args.mbs, args.hp)
    except PlanError as e:
        raise CLIError(str(e)) from None
    if args.seq_len is not None and args.seq_len % (2 * cp * args.hp):
        what = "2*cp" if args.hp == 1 else "2*cp*hp"
        raise CLIError(f"--seq-len {args.seq_len} must be a multiple of {what} = {2 * cp * args.hp}")
    return cp


def _model(args) -> str:
    """The planner's model: a reference name, or a Hugging Face config (``plan_graphs.hf_model``)."""
    from ..tools.plan import MODELS
    from ..tools.plan_graphs import hf_model
    from . import models

    if args.hf_config:
        return hf_model(models.load_config_json(args.hf_config))
    if args.model in MODELS:
        return args.model
    if not Path(args.model).is_dir():
        raise CLIError(f"--model {args.model}: neither one of {', '.join(MODELS)} nor a model directory")
    transformers = models.import_transformers("--model DIR")
    try:
        return hf_model(transformers.AutoConfig.from_pretrained(args.model, local_files_only=True))
    except (OSError, ValueError, KeyError) as e:
        raise CLIError(f"--model {args.model}: no usable config.json in it ({' '.join(str(e).split())})") from None


def plan(args) -> int:
    from ..tools import paper_tables
    from ..tools.plan import format_plan, plan as make_plan
    from ..tools.plan_graphs import model_label

    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    if args.table:
        print(paper_tables.write_table(args.table, gpu_mem_gib=args.gpu_mem_gb or 80.0, dtype=args.dtype,
                                       overhead_gib=args.overhead_gb, cache_dir=cache_dir, jobs=args.jobs,
                                       log=lambda m: print(m, file=sys.stderr, flush=True)))
        return 0
    cp = _request(args)
    start = time.perf_counter()
    plans = make_plan(args.model, args.gpus, args.gpu_mem_gb, cp=cp, checkpoint=args.checkpoint, mbs=args.mbs,
                      dtype=args.dtype, overhead_gib=args.overhead_gb, cache_dir=cache_dir, jobs=args.jobs,
                      hp=args.hp)
    header = (f"longshield-fx plan: {model_label(args.model)}, {args.gpus} x {args.gpu_mem_gb:g} GiB, mbs {args.mbs}, "
              f"{args.dtype} ({time.perf_counter() - start:.0f}s)")
    print(format_plan(list(plans), header=header))
    if args.seq_len is not None:
        print(f"\nat T = {args.seq_len}:")
        for p in plans:
            b = p.breakdown(args.seq_len)
            fits = "fits" if b.total <= p.gpu_mem else "OOM"
            print(f"  {p.title:<22} " + " ".join(f"{k} {v:.2f}" for k, v in b.as_gib().items()) + f"  ({fits})")
    if args.search_attention:
        T = args.seq_len or plans[0].max_T
        if T is None:
            raise CLIError("--search-attention: the DP layout fits no T; pass --seq-len")
        print("\n" + search_table(args.model, args.gpus, T, args.mbs, args.dtype, args.search_attention))
    return 0


def search_table(model: str, gpus: int, T: int, mbs: int, dtype: str, cluster: str) -> str:
    """Every attention layout of ``gpus`` sequence-parallel ranks, fastest first, by the cost model."""
    from ..tools.cost_model import HARDWARE, search_attention
    from ..tools.plan import DTYPES, model_shape, tokens

    shape = model_shape(model)
    costs = search_attention(HARDWARE[cluster], gpus, batch=mbs, seq_len=T, heads=shape["heads"],
                             kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], elem_bytes=DTYPES[dtype].itemsize)
    lines = [f"attention layouts of {gpus} ranks on {cluster} at T={tokens(T)} (cost model, one layer fwd + bwd, "
             "LoongTrain section 4.5):", f"{'layout':<44} {'total ms':>9} {'ring ms':>9} {'all-to-all ms':>14}"]
    lines += [f"{c.layout.label():<44} {c.total * 1e3:9.3f} {c.ring * 1e3:9.3f} {c.all_to_all * 1e3:14.3f}"
              for c in costs]
    best = costs[0]
    sizes = {"cp": best.layout.cp, "hp": best.layout.hp}
    dims = tuple(d for d in (("cp", "hp") if best.layout.head_first else ("hp", "cp")) if sizes[d] > 1)
    lines.append(f"chosen: {best.layout.label()} ({best.total * 1e3:.3f} ms per layer): mesh dims {dims}"
                 + (f", compile(..., inner_ring={best.layout.w})" if best.layout.w != best.layout.cp else ""))
    return "\n".join(lines)
