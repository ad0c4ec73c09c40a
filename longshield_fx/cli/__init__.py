"""``longshield-fx``: command-line entry points (``train``, ``audit``, ``inspect``, ``plan``).

``longshield-fx train`` trains a causal LM with DP-SGD on an embedded long-document corpus:
this machine's Python standard library sources, read as bytes (a byte-level vocabulary of
256) and treated as a private codebase. Nothing is downloaded. Under ``torchrun`` with
``--cp N`` the same job runs context-parallel (gloo on CPU, NCCL on GPU).

Privacy, as the CLI applies it: the unit is the document (one stdlib file = one row: its
first T bytes, padding labelled -100; truncation is reported), so the printed ε is per
document (add/remove one document), at δ = the largest power of ten
<= min(1e-5, N^-1.1) by default, PLD accountant.
``--seed`` seeds the model initialisation (and dropout) only; the noise and the Poisson
sampling come from secret ChaCha20 streams keyed by the OS (``--insecure-seed`` is a test-only
escape hatch that voids the guarantee). Losses, timings, batch sizes and counts are not covered by ε
and are written only under ``not_covered_by_dp``. Checkpoints (``checkpoints/ckpt-*.pt``) are
SECRET: they hold the sampling key (which documents each step sampled).

``longshield-fx audit`` runs that job once with canaries: the claimed ε beside an empirical lower bound.

``longshield-fx inspect`` builds the training graph for one batch and shows what the passes
did: the pipeline, node counts, the per-sample rule of every parameter, the inserted
collectives and their bytes, and one transformer block's rewritten graph (graphviz DOT/SVG).

``longshield-fx plan`` predicts the longest context that fits on N GPUs.

``python -m longshield_fx`` is the same program.
"""
from __future__ import annotations

import os
import sys

from . import audit, inspect, plan, train
from ..errors import DataError
from .common import PROG, CLIError, Formatter, Parser, rank, under_torchrun

__all__ = ["PROG", "CLIError", "build_parser", "main"]


def build_parser() -> Parser:
    """The ``longshield-fx`` parser: one sub-parser per subcommand module (same ``Parser``
    class, so every usage error is one line), each setting ``func``."""
    parser = Parser(prog=PROG, description=__doc__.replace("``", ""), formatter_class=Formatter,
                    epilog="Errors print one line; set LONGSHIELD_FX_DEBUG=1 for the traceback.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,audit,inspect,plan}")
    train.add_parser(sub)
    audit.add_parser(sub)
    inspect.add_parser(sub)
    plan.add_parser(sub)
    parser.commands = sub.choices  # name -> its parser
    return parser


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def main(argv=None) -> int:
    return _run(argv)


def _run(argv) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand, whose --help lists its flags
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    args.argv = argv  # which flags were given (``train --resume DIR`` takes the others from the run)
    prefix = f"{PROG} {args.command}"
    finished = False
    try:
        code = args.func(args)
        finished = True
        return code
    except (CLIError, DataError) as e:
        print(f"{prefix}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError, ImportError, TypeError) as e:
        if os.environ.get("LONGSHIELD_FX_DEBUG"):
            raise
        where = f" [rank {rank()}]" if under_torchrun() else ""
        print(f"{prefix}{where}: error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1
    finally:
        tear_down_processes(finished)


def tear_down_processes(finished: bool) -> None:
    """Destroy the process groups (torchrun), quietly."""
    import warnings

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    from .._torch import destroy_process_groups

    with warnings.catch_warnings():
        # torch wraps the deprecated ``torch.distributed.reduce_op`` object's __getattribute__ in
        # typing_extensions' @deprecated (distributed_c10d.py, "use torch.distributed.ReduceOp"), so
        # even an isinstance() test of it warns: destroy_process_groups tests every live object for
        # a DeviceMesh, and each rank printed that FutureWarning twice at the end of every run.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated",
                                category=FutureWarning, module=r"torch\._opaque_base")
        destroy_process_groups(peers_finished=finished)


if __name__ == "__main__":
    raise SystemExit(main())
