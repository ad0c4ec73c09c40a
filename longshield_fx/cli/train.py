"""``longshield-fx train``: DP-SGD on this machine's Python standard library sources.

This module holds the flags and the order of the run (``train``); the steps live beside it:
``train_setup`` (flags, run folder, data, σ), ``train_build`` (engine, sampler, restore, the
announcement), ``train_loop`` (the steps, a checkpoint on Ctrl-C) and ``train_report`` (outputs).
"""
from __future__ import annotations

import argparse
import time

import torch

from .common import EXPECTED_BATCH_SIZE, Formatter, add_model_args, nonneg_float, nonneg_int, positive_float, \
    positive_int, setup_distributed
from .job import Job
from .train_build import announce, compile_run, restore
from .train_data import add_data_args, build_model_for
from .train_loop import run_steps
from .train_report import finish
from .train_setup import check_args, claim_run_dir, decide_sigma, fsdp_dims, load_corpus, open_run_dir

DESCRIPTION = (
    "DP-SGD training of a byte-level causal LM on this machine's Python standard library sources\n"
    "(the embedded 'private codebase'): Poisson-sampled logical batches cut into fixed-shape masked\n"
    "physical batches, per-sample clipping and Gaussian noise inside the compiled graph, AdamW.\n"
    "The privacy unit is the DOCUMENT: one stdlib file is one row (its first T bytes; the rest of a\n"
    "longer file is not used, and the truncation is reported), sampled and clipped as one sample, so ε\n"
    "is per document (add/remove one document). σ is calibrated before training so that ε after\n"
    "--steps steps is <= --target-epsilon at δ = the largest power of ten <= min(1e-5, N^-1.1)\n"
    "(N = number of documents), unless --sigma is given. The DP noise and the sampling come from\n"
    "secret ChaCha20 streams keyed by the OS; --seed seeds the model initialisation only.\n\n"
    "Writes to --out: metrics.jsonl (one JSON line per step), loss_vs_epsilon.png, summary.json,\n"
    "final_model.pt (the trained model's state dict: covered by ε) and checkpoints/ckpt-<step>.pt.\n"
    "Training losses, timings and counts (non-finite samples; batch sizes and tokens only with\n"
    "--log-private-stats) come from the private data without noise: they are NOT covered by ε and\n"
    "are written only under the key 'not_covered_by_dp'. Checkpoints are SECRET: they hold the\n"
    "sampling key (which documents each step sampled); keep them like the data. The noise key is\n"
    "never saved: a resumed run draws fresh noise. Ctrl-C or SIGTERM stops the run after the step in\n"
    "flight, with a checkpoint of it, and the same command continues (under torchrun every rank stops\n"
    "after the same step).\n\n"
    "Your own model and documents: --model DIR (a local Hugging Face model directory, weights and\n"
    "tokenizer loaded) and --data PATH (a folder of text files, a .jsonl file with 'text' and an\n"
    "optional privacy-unit 'id', or a .txt file with one document per line); a document longer than T\n"
    "is cut into rows that stay one privacy unit (up to --max-rows rows). --lora R trains LoRA adapters\n"
    "only (peft). The trained model is written to --out/model/ in Hugging Face format, with\n"
    "--out/privacy.json (ε, δ, accountant, unit, q, σ, steps, C, clipping).\n\n"
    "Context parallel: torchrun --standalone --nproc-per-node 2 -m longshield_fx train --cp 2\n"
    "(world size W = dp * cp; each of the W/cp data-parallel groups takes a share of every\n"
    "logical batch; all ranks read the same corpus and build the same model from --seed, rank 0's noise\n"
    "and sampling keys are broadcast to all; rank 0 prints and writes). --fsdp dp,cp shards the model\n"
    "states (parameters, clipped sums, AdamW) over those mesh dims, --fsdp cp within each cp group\n"
    "(hybrid); its checkpoints are torch.distributed.checkpoint folders, resumable on another world size.")


def add_parser(sub) -> None:
    t = sub.add_parser("train", formatter_class=Formatter, description=DESCRIPTION,
                       help="DP-SGD training on this machine's Python standard library sources")
    add_model_args(t, seq_len_default=2048)
    t.set_defaults(physical_batch_size=4, func=train)
    _privacy_args(t)
    add_data_args(t)
    _run_args(t)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _privacy_args(p) -> None:
    p.add_argument("--steps", type=positive_int, default=50, help="optimizer steps (Poisson logical batches)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--expected-batch-size", type=positive_float, default=EXPECTED_BATCH_SIZE, metavar="E",
                      help="expected logical batch size; the sampling rate is q = E/N. N, the number of units, is "
                      "private, and q (published with ε) and E together give it exactly: pass --sample-rate to "
                      "publish q as your own choice instead")
    rate.add_argument("--sample-rate", type=_rate, default=None, metavar="Q",
                      help="Poisson sampling rate q in (0, 1], chosen by you and published with ε; the expected "
                      "batch size qN is then private (default: q = E/N from --expected-batch-size)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--target-epsilon", type=positive_float, default=8.0, metavar="EPS",
                   help="ε budget for the whole run: σ is calibrated to it before training")
    g.add_argument("--sigma", type=nonneg_float, default=None,
                   help="noise multiplier σ, instead of calibrating one from --target-epsilon (default: calibrated)")
    p.add_argument("--delta", type=positive_float, default=None,
                   help="δ of the (ε, δ) guarantee, per document (default: the largest power of ten <= "
                   "min(1e-5, N^-1.1), N = number of documents: well below 1/N, as Ponomareva et al. 2023 'How to "
                   "DP-fy ML' recommend, so that a mechanism leaking one whole document with probability δ leaks "
                   "far less than one document in expectation; a power of ten, so that δ tells N's order of "
                   "magnitude at most)")
    p.add_argument("--accountant", choices=["pld", "rdp"], default="pld",
                   help="privacy accountant (dp-accounting): pld is the tightest, rdp is looser")
    p.add_argument("--insecure-seed", type=int, default=None, metavar="N",
                   help="TESTS ONLY, VOIDS THE PRIVACY GUARANTEE: derive the noise key and the sampling key from "
                   "this public seed (separate keys), so runs are reproducible by anyone; a warning is printed "
                   "and the seed is recorded in summary.json and signature.json (default: none; the keys are secret, "
                   "from the OS)")
    p.add_argument("--log-private-stats", action="store_true",
                   help="also write the logical batch size and token counts of every step (under "
                   "'not_covered_by_dp' in metrics.jsonl and summary.json): they are computed from the private "
                   "data without noise and are NOT covered by ε")


def _run_args(p) -> None:
    _optimizer_corpus_device_args(p)
    _output_args(p)


def _optimizer_corpus_device_args(p) -> None:
    """The run flags ``longshield-fx audit`` shares (it writes no checkpoints)."""
    p.add_argument("--lr", type=positive_float, default=2e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=nonneg_float, default=0.01, help="AdamW weight decay")
    p.add_argument("--max-files", type=nonneg_int, default=400,
                   help="stdlib .py files read (sorted by path) for the corpus; 0 reads all")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model and the compiled step run (cuda: NCCL under torchrun; per-sample "
                   "gradients and clipped sums checked on one H100, docs/gpus.md; NCCL across ranks not yet run)")


def _output_args(p) -> None:
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default: runs/train, or the --resume directory). Its checkpoints/ are "
                   "SECRET: they hold the sampling key")
    p.add_argument("--save-every", type=nonneg_int, default=25, metavar="K",
                   help="write a checkpoint every K steps, at the end, and when Ctrl-C or SIGTERM stops the run "
                   "after a step (0: never)")
    p.add_argument("--keep-checkpoints", type=positive_int, default=2, metavar="N",
                   help="keep the N newest checkpoints, delete older ones")
    p.add_argument("--fsdp", default=None, metavar="DIMS",
                   help="shard model states (parameters, clipped sums, AdamW states) over these mesh dims under "
                   "torchrun: 'dp,cp' over every rank (ZeRO-3), 'cp' within each cp group, replicated over dp; a "
                   "dim of size 1 is left out. Checkpoints become DCP folders that resume on any world size "
                   "(default: none, every rank holds everything)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run in DIR (its --out, or its checkpoints/ folder) from its newest complete "
                   "checkpoint, with that run's own flags: a flag given here that differs from the run's is "
                   "refused by name. The checkpoint is SECRET (the sampling key): the resumed run samples as the "
                   "uninterrupted one would, with fresh noise. Without --resume, the same command run again in "
                   "the same --out continues its run the same way (so torchrun --max-restarts restarts it), and "
                   "an --out holding another run is refused (default: none)")
    p.add_argument("--fork", action="store_true",
                   help="continue from a checkpoint older than the newest step in the run's ledger "
                   "(privacy_ledger.jsonl in --out), or start over in an --out whose ledger holds steps: without "
                   "it that is refused, since the released steps would be redrawn with fresh noise. ε then covers "
                   "every step in the ledger, both branches (a redrawn batch counts as the same subsampled batch "
                   "released twice), and privacy.json says the run is a fork")



def train(args) -> int:
    """Validate, set up processes, corpus and model, decide σ (or resume), compile, restore,
    announce, run the steps, report. Ctrl-C or SIGTERM stops at the end of a step, with a checkpoint
    (``train_loop.run_steps``)."""
    job = Job(args, time.time())
    check_args(job)
    claim_run_dir(job)
    job.mesh, job.dp, job.dp_rank = setup_distributed(args.cp, args.device, "train")
    job.fsdp = fsdp_dims(args.fsdp, job.mesh)
    load_corpus(job)
    build_model_for(job)
    if args.data and not args.no_pack:
        from ..losses import packing_refused

        job.unpacked_why = packing_refused(job.model.lm)
        job.packed = job.unpacked_why is None
    job.device = torch.device(args.device)
    job.model.to(job.device)
    state = decide_sigma(job)
    compile_run(job)
    if state is not None:
        restore(job, state)
    elif args.fork:  # starting over in a folder whose ledger holds released steps
        job.engine.accountant.released_elsewhere = job.ledger.admit(None, fork=True, fork_hint="add --fork",
                                                                    where="train")
    open_run_dir(job)
    announce(job)
    stopped = run_steps(job)
    return stopped if stopped is not None else finish(job)
