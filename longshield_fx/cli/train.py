"""``longshield-fx train``: DP-SGD on this machine's Python standard library sources.

The run is a sequence of named steps over one ``Job`` (see ``train``); the loop itself is
``train_loop.run_steps`` and the closing report ``train_loop.finish``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoints import (CHECKPOINT_FORMAT, atomic_save, checkpoint_dir, jsonable, list_checkpoints, load_latest,
                          resolve_resume, signature_diff)
from .common import (CLIError, Formatter, add_model_args, check_model_flags, check_seq_len, nonneg_float, nonneg_int,
                     positive_float, positive_int, rank, say, setup_distributed)
from ..run_core import DELTA_RULE, default_delta
from .corpus import PRIVACY_UNIT, stdlib_corpus
from .train_data import add_data_args, build_model_for, check_data_args, data_signature, load_documents_for

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
    "never saved: a resumed run draws fresh noise.\n\n"
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
    rate.add_argument("--expected-batch-size", type=positive_float, default=8.0, metavar="E",
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
                   help="write a checkpoint every K steps and at the end (0: never)")
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


# --- the run --------------------------------------------------------------------------------

@dataclass
class Job:
    """Everything one training run holds, filled in by the steps of ``train`` in order."""

    args: object
    t_start: float
    run_dir: Path = None
    resumed_run: Path | None = None      # the run dir --resume named
    ckpt_folder: Path | None = None
    mesh: object = None
    fsdp: tuple | None = None            # mesh dims the model states are sharded over (--fsdp)
    dp: int = 1
    dp_rank: int = 0
    corpus: object = None                # the training data: cli.corpus.Corpus or cli.documents.Documents
    eval_set: object = None              # held-out Documents, or None
    packed: bool = False                 # --data packed into shared rows (not --no-pack; one process or dp alone)
    unpacked_why: str | None = None      # why a --data run that would pack does not (the model)
    unit_slots: int = 0                  # packed: units per physical batch at most (its unit slots)
    packing: list = field(default_factory=lambda: [0, 0, 0, 0])  # packed: padding slots, slots, rows used, pieces
    tokenizer: object = None             # the --model DIR tokenizer, or None (bytes)
    unit: str = PRIVACY_UNIT             # what ε protects, as printed beside it
    q: float = 0.0
    delta: float = 0.0
    model: torch.nn.Module = None
    model_desc: dict = None
    model_name: str = ""
    device: torch.device = None
    sigma: float = 0.0
    signature: dict = None
    engine: object = None
    opt: torch.optim.Optimizer = None
    batches: object = None
    resumed_from: Path | None = None     # the checkpoint file resumed from
    explicit_resume: bool = False        # --resume DIR (else: continuing the --out's own checkpoints)
    checkpoint: tuple | None = None      # (state, path) of the newest checkpoint, once read
    restart_if_same: list | None = None  # outputs found in --out with no checkpoint
    ledger: object = None                # run_core.RunLedger of run_dir (and of the run --resume continues)
    start_step: int = 0
    tokens_seen: int = 0
    elapsed_before: float = 0.0
    rows: list = field(default_factory=list)
    t_loop: float = 0.0
    observe: object = None               # ``longshield-fx audit`` only: called with (job, logical) after finalize
    eval_model: torch.nn.Module = None   # what scores the held-out documents (default: model; the audit's: without
                                         # its canary parameter)

    @property
    def rank0(self) -> bool:
        return rank() == 0

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"


def train(args) -> int:
    """Validate, set up processes, corpus and model, decide σ (or resume), compile, restore,
    announce, run the steps, report."""
    from .train_loop import finish, run_steps

    job = Job(args, time.time())
    _check_args(job)
    _claim_run_dir(job)
    job.mesh, job.dp, job.dp_rank = setup_distributed(args.cp, args.device, "train")
    job.fsdp = _fsdp_dims(args.fsdp, job.mesh)
    _load_corpus(job)
    build_model_for(job)
    if args.data and not args.no_pack:
        from ..losses import packing_refused

        job.unpacked_why = packing_refused(job.model.lm)
        job.packed = job.unpacked_why is None
    job.device = torch.device(args.device)
    job.model.to(job.device)
    state = _decide_sigma(job)
    _compile(job)
    if state is not None:
        _restore(job, state)
    elif args.fork:  # starting over in a folder whose ledger holds released steps
        job.engine.accountant.released_elsewhere = job.ledger.admit(None, fork=True, fork_hint="add --fork",
                                                                    where="train")
    _open_run_dir(job)
    _announce(job)
    try:
        run_steps(job)
    except KeyboardInterrupt:
        newest = list_checkpoints(checkpoint_dir(job.run_dir))
        say(f"interrupted after step {job.batches.step - 1}; "
            + (f"the newest checkpoint is {newest[0][1].name}: continue with the same command, or "
               f"longshield-fx train --resume {job.run_dir}" if newest else
               "no checkpoint was written yet (--save-every): the same command starts the run over"),
            file=sys.stderr)
        raise
    return finish(job)


# Flags that may change between the sessions of one run: where and how often it writes, what it logs,
# and the layout it runs on (a checkpoint resumes on any world size).
_PER_SESSION = {"out", "resume", "save_every", "keep_checkpoints", "eval_every", "log_private_stats", "device",
                "cp", "fsdp", "fork"}
_OUTPUTS = ("metrics.jsonl", "summary.json", "privacy.json", "final_model.pt", "signature.json")


def _claim_run_dir(job: Job) -> None:
    """The run dir belongs to one run. With --resume, take the run's own flags from its newest
    checkpoint (a differing flag given here is refused by name). Without, a run dir that already
    holds checkpoints is continued when they are this command's run (checked by signature in
    ``_decide_sigma``); one that holds outputs but no checkpoint is refused unless its signature
    is this command's (a run stopped before its first checkpoint starts over)."""
    args = job.args
    if args.resume:
        job.checkpoint = load_latest(job.ckpt_folder)
        _take_saved_flags(args, job.checkpoint[0].get("args") or {})
        job.explicit_resume = True
        return
    if list_checkpoints(checkpoint_dir(job.run_dir)):
        job.resumed_run, job.ckpt_folder = job.run_dir, checkpoint_dir(job.run_dir)
        return
    held = [name for name in _OUTPUTS if (job.run_dir / name).exists()]
    if held:
        job.restart_if_same = held


def _take_saved_flags(args, saved: dict) -> None:
    given = _given_flags(args)
    differing = [f"--{dest.replace('_', '-')} {getattr(args, dest)!r} (the run has {value!r})"
                 for dest, value in saved.items()
                 if dest in given and dest not in _PER_SESSION and jsonable(getattr(args, dest)) != value]
    if differing:
        raise CLIError(f"--resume {args.resume}: " + "; ".join(differing)
                       + (": this flag differs" if len(differing) == 1 else ": these flags differ")
                       + " from the run being resumed: drop them to continue it with its own flags, or start a new "
                       "run with a new --out")
    for dest, value in saved.items():
        if dest not in given and dest not in _PER_SESSION and hasattr(args, dest):
            setattr(args, dest, value)


def _given_flags(args) -> set[str]:
    """The dests of the flags on the command line (``args.argv``), not left at their defaults."""
    from . import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[args.command]
    given = set()
    for action in sub._actions:
        for token in getattr(args, "argv", []):
            if any(token == o or token.startswith(o + "=") for o in action.option_strings):
                given.add(action.dest)
    return given


def saved_flags(args) -> dict:
    """The run's flags, as a checkpoint keeps them for ``--resume DIR``."""
    skip = {"func", "command", "argv"} | _PER_SESSION
    return jsonable({k: v for k, v in vars(args).items() if k not in skip})


def _check_args(job: Job) -> None:
    """Fail fast on flags, before the corpus and the processes."""
    args = job.args
    if args.steps < 1:
        raise CLIError(f"--steps must be >= 1, got {args.steps}")
    check_seq_len(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA device is available")
    check_model_flags(args)
    check_data_args(args)
    job.run_dir = Path(args.out) if args.out else None
    if args.resume:
        job.resumed_run, job.ckpt_folder = resolve_resume(args.resume)
        job.run_dir = job.run_dir or job.resumed_run
    job.run_dir = job.run_dir or Path("runs/train")
    from ..run_core import RunLedger

    job.ledger = RunLedger(job.run_dir, job.resumed_run)


def _fsdp_dims(text: str | None, mesh) -> tuple[str, ...] | None:
    """--fsdp 'dp,cp' -> the mesh dims to shard over (a dim the mesh does not have, size 1, is left out)."""
    if text is None:
        return None
    dims = tuple(d.strip() for d in text.split(",") if d.strip())
    unknown = [d for d in dims if d not in ("dp", "cp")]
    if unknown or not dims:
        raise CLIError(f"--fsdp takes mesh dims among dp and cp, e.g. 'dp,cp' or 'cp'; got {text!r}")
    if mesh is None:
        raise CLIError("--fsdp shards model states over ranks: run under torchrun, e.g. torchrun --standalone "
                       "--nproc-per-node 4 -m longshield_fx train --cp 2 --fsdp dp,cp")
    present = tuple(d for d in dims if d in mesh.mesh_dim_names)
    if not present:
        raise CLIError(f"--fsdp {text}: none of those dims has more than one rank here (mesh {mesh.mesh_dim_names})")
    return present


def _load_corpus(job: Job) -> None:
    """The training data (--data, else the embedded corpus) and the held-out set, before the
    model: a bad file fails before anything is built or written."""
    args = job.args
    if args.data:
        job.corpus, job.eval_set = load_documents_for(job)
    else:
        job.corpus = stdlib_corpus(args.seq_len, args.max_files or None)
    N = job.corpus.num_units
    if args.sample_rate is not None:
        job.q = args.sample_rate
    elif args.expected_batch_size > N:
        held_out = f" left for training after --eval-fraction {args.eval_fraction:g} held out " \
                   f"{job.eval_set.num_units}" if args.data and args.eval_fraction else ""
        raise CLIError(f"--expected-batch-size {args.expected_batch_size:g} exceeds the number of privacy units "
                       f"N = {N}{held_out}; lower it" + ("" if args.data else " or raise --max-files")
                       + (" or the held-out fraction" if held_out else ""))
    else:
        job.q = args.expected_batch_size / N
    job.delta = args.delta if args.delta is not None else default_delta(N)


def sampling_choice(args) -> dict:
    """The user's sampling flag: q itself when chosen (public), else E (q = E/N is derived)."""
    if args.sample_rate is not None:
        return {"sample_rate": args.sample_rate}
    return {"expected_batch_size": args.expected_batch_size}


def make_signature(job: Job, sigma: float) -> dict:
    """What a checkpoint must match to be resumed by this run."""
    args = job.args
    return jsonable({
        "model": job.model_desc, "init_seed": args.seed,
        "dp": {"max_grad_norm": args.max_grad_norm, "noise_multiplier": sigma, "clipping": args.clipping,
               **sampling_choice(args), "delta": job.delta, "accountant": args.accountant,
               "insecure_seed": args.insecure_seed,
               "target_epsilon": None if args.sigma is not None else args.target_epsilon},
        "seq_len": args.seq_len, "physical_batch_size": args.physical_batch_size, "steps": args.steps,
        "corpus": data_signature(job),
        "optimizer": {"name": "AdamW", "lr": args.lr, "weight_decay": args.weight_decay},
    })


def _decide_sigma(job: Job) -> dict | None:
    """σ: given, calibrated to the target ε, or the resumed checkpoint's (after refusing a
    checkpoint of a different run, before calibrating and compiling). Returns that checkpoint."""
    args, state = job.args, None
    if job.ckpt_folder is not None:
        state, job.resumed_from = job.checkpoint or load_latest(job.ckpt_folder)
        saved = state["signature"]
        sigma = args.sigma if args.sigma is not None else saved.get("dp", {}).get("noise_multiplier")
        diffs = signature_diff(saved, make_signature(job, sigma))
        if diffs and not job.explicit_resume:
            raise CLIError(f"--out {job.run_dir} holds another run's checkpoints ({_listed(diffs)}); nothing was "
                           f"changed: pass a new --out, or --resume {job.run_dir} to continue that run with its flags")
        if diffs:
            raise CLIError(f"refusing to resume from {job.resumed_from}: it was written by a different run ("
                           + _listed(diffs) + ")")
        # Same calibration inputs (target ε, δ, q, steps, accountant): the checkpoint's σ is the calibrated one.
    elif args.sigma is not None:
        sigma = args.sigma
    else:
        sigma = _calibrated_sigma(job)
    job.sigma, job.signature = sigma, make_signature(job, sigma)
    before = _read_signature(job.run_dir) if job.restart_if_same else None
    if job.restart_if_same and before != job.signature:
        raise CLIError(f"--out {job.run_dir} already holds {'another run' if before else 'a run'}'s outputs "
                       f"({', '.join(job.restart_if_same)}) and no checkpoint to continue from; nothing was "
                       "changed: pass a new --out")
    _check_ledger(job, state)
    if job.restart_if_same:
        say(f"{job.run_dir} holds this run, stopped before its first checkpoint: starting it over")
    return state


def _check_ledger(job: Job, state: dict | None) -> None:
    """Refuse, before anything is built or written, to continue from a step older than the run
    ledger's newest (or to start over in a folder whose ledger holds steps) unless --fork."""
    from ..run_core import RollbackRefused

    what = f"its newest complete checkpoint, {job.resumed_from.name}," if state else "this run, starting over,"
    try:  # audit has no --fork: it resumes nothing
        job.ledger.refuse_older((state or {}).get("step", 0), fork=getattr(job.args, "fork", False), where="train",
                                what=what, fork_hint="add --fork")
    except RollbackRefused as e:
        raise CLIError(str(e).removeprefix("train: ")) from None


def _calibrated_sigma(job: Job) -> float:
    """σ calibrated to --target-epsilon (on rank 0, broadcast to every rank)."""
    from ..run_core import calibrated_sigma

    args = job.args
    try:
        return calibrated_sigma(args.target_epsilon, job.delta, job.q, args.steps, args.accountant)
    except ValueError as e:  # an unreachable target, a vacuous δ: the flags, not the program
        raise CLIError(f"--target-epsilon {args.target_epsilon:g} with --delta {job.delta:g}: {e}") from None


def _listed(diffs: list[str]) -> str:
    return "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")


def _read_signature(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "signature.json").read_text())
    except (OSError, ValueError):
        return None


def _compile(job: Job, dataset=None) -> None:
    """Engine, AdamW and the Poisson sampler over ``dataset`` (default: the corpus, one row per
    document; ``longshield-fx audit`` passes the corpus plus its included canaries)."""
    import longshield_fx as lf

    from ..data import PoissonBatches

    args = job.args
    # No seed: the noise key is 256 bits from the OS (rank 0's, broadcast), unless --insecure-seed.
    config = lf.DPConfig(args.max_grad_norm, job.sigma, clipping=args.clipping, accountant=args.accountant,
                         insecure_seed=args.insecure_seed)
    checkpoint = None if args.checkpoint == "none" else args.checkpoint
    if job.packed:
        _compile_packed(job, config, checkpoint)
        return
    job.engine = lf.compile(job.model, job.mesh, config=config, fsdp=job.fsdp, checkpoint=checkpoint)
    _lower_or_refuse(job, dataset)
    job.opt = torch.optim.AdamW(job.model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    # Built at the same point on every rank (its key is broadcast from rank 0); one row = one document.
    dataset = job.corpus.dataset() if dataset is None else dataset
    job.batches = PoissonBatches(dataset, sample_rate=job.q, physical_batch_size=args.physical_batch_size,
                                 insecure_seed=args.insecure_seed, steps=args.steps)


def _compile_packed(job: Job, config, checkpoint) -> None:
    """Packed documents: physical batches of at most B·R rows (the memory of B padded units,
    fewer while E is small: ``packing.packed_rows``) holding up to 4 units per row, Poisson
    sampling over units (``packing.PackedPoissonBatches``)."""
    import longshield_fx as lf

    from ..errors import UnsupportedModelError
    from ..packing import PackedPoissonBatches, empty_batch, packed_rows, unit_slots_for

    args = job.args
    rows = packed_rows(job.corpus.rows_per_unit, args.physical_batch_size, job.q * job.corpus.num_units)
    job.unit_slots = unit_slots_for(rows)
    job.engine = lf.compile(lf.PackedCausalLMLoss(job.model.lm), job.mesh, config=config, checkpoint=checkpoint,
                            fsdp=job.fsdp, packed_units=job.unit_slots)
    try:
        job.engine.lower(*(t.to(job.device) for t in empty_batch(rows, args.seq_len, job.unit_slots).tensors()))
    except UnsupportedModelError as e:
        raise CLIError(f"{job.model_name} cannot be trained with DP by longshield_fx: {e}") from None
    job.opt = torch.optim.AdamW(job.model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    job.batches = PackedPoissonBatches(job.corpus.pieces(), job.q, seq_len=args.seq_len, rows=rows,
                                       unit_slots=job.unit_slots, insecure_seed=args.insecure_seed, steps=args.steps)


def _lower_or_refuse(job: Job, dataset) -> None:
    """Capture and rewrite the step now, on one physical batch's shapes, so that a model the
    passes refuse fails with its reason before any output is written."""
    from ..errors import UnsupportedModelError

    data = job.corpus.dataset() if dataset is None else dataset
    first_row = [0] * job.args.physical_batch_size
    example = [t[first_row].to(job.device) for t in data.tensors]
    try:
        with torch.random.fork_rng(devices=[job.device] if job.device.type == "cuda" else []):
            job.engine.lower(*example)
    except UnsupportedModelError as e:
        raise CLIError(f"{job.model_name} cannot be trained with DP by longshield_fx: {e}") from None


def _restore(job: Job, state: dict) -> None:
    """Model, optimizer, the secret sampling stream, the accountant and the RNG (the noise is
    never restored: the engine draws a fresh key)."""
    import longshield_fx as lf

    if bool(state.get("dcp")) != bool(job.fsdp):
        raise CLIError(f"{job.resumed_from} was written " + ("with" if state.get("dcp") else "without")
                       + " --fsdp (sharded model states); resume it " + ("with --fsdp under torchrun"
                                                                         if state.get("dcp") else "without --fsdp"))
    if state.get("dcp"):  # model, optimizer, engine and sampler, re-sharded for this run's mesh
        job.ledger.sync()  # the ledger load_checkpoint reads is run_dir's: it holds every folder's steps
        lf.load_checkpoint(job.ckpt_folder / state["dcp"], job.engine, job.opt, job.batches, fork=job.args.fork,
                           run_dir=job.run_dir)
    else:
        elsewhere = job.ledger.admit(state["engine"] | {"sampler": state["sampler"]}, fork=job.args.fork,
                                     fork_hint="add --fork", where="train")
        job.model.load_state_dict(state["model"])
        job.opt.load_state_dict(state["optimizer"])
        job.batches.load_state_dict(state["sampler"])  # continues the same secret sampling stream
        # the accountant (and the ledger's other branches, on a fork); the noise key is fresh
        job.engine.load_state_dict(state["engine"], fork=job.args.fork, released_elsewhere=elsewhere)
    torch.set_rng_state(state["torch_rng"])
    if state.get("cuda_rng") is not None and job.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"])
    job.start_step, job.tokens_seen, job.elapsed_before = state["step"], state["tokens"], state["elapsed_s"]


def _read_metrics(path: Path, upto: int | None = None) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if upto is None or row.get("step", 0) <= upto:
                rows.append(row)
    return rows


def _open_run_dir(job: Job) -> None:
    """Keep the metrics of the steps before the checkpoint (lines a killed run wrote after it
    are dropped); write the signature."""
    if job.start_step:
        job.rows = _read_metrics((job.resumed_run or job.run_dir) / "metrics.jsonl", upto=job.start_step)
    if not job.rank0:
        return
    job.run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir(job.run_dir).mkdir(exist_ok=True)
    tmp = job.metrics_path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in job.rows))
    os.replace(tmp, job.metrics_path)
    (job.run_dir / "signature.json").write_text(json.dumps(job.signature, indent=1) + "\n")


def _announce(job: Job) -> None:
    args, corpus, T, N = job.args, job.corpus, job.args.seq_len, job.corpus.num_units
    n_params = sum(p.numel() for p in job.model.parameters())
    trainable = sum(p.numel() for p in job.model.parameters() if p.requires_grad)
    world = f"cp={args.cp}, dp={job.dp}" if job.mesh is not None else "one process"
    say(f"model: {job.model_name}, {n_params:,} parameters"
        + (f" ({trainable:,} trained)" if trainable != n_params else "")
        + f", T={T}, {world}, device {job.device.type}, checkpointing {args.checkpoint}")
    if args.data:
        say(f"data: {args.data}: {corpus.describe()} (these counts are NOT covered by DP)")
        if job.eval_set is not None:
            say(f"held out for evaluation: {job.eval_set.describe()}; evaluation losses are computed without noise "
                "and are NOT covered by ε (held-out documents are never trained on, so ε does not protect them)")
    else:
        say(f"corpus: {N} documents (one stdlib file per row, its first {T} bytes; the privacy unit is the document); "
            f"{corpus.truncated} truncated to {T} bytes, {corpus.fraction_used:.1%} of the corpus bytes used"
            + (f", {corpus.skipped} file{'s' * (corpus.skipped != 1)} under 2 bytes left out" if corpus.skipped else "")
            + " (these counts are NOT covered by DP)")
    physical = (f"packed into physical batches of {job.batches.physical_batch_size} rows x {T} holding up to "
                f"{job.unit_slots} units each (--no-pack: {args.physical_batch_size} units of padded rows)") \
        if job.packed else f"physical batch {args.physical_batch_size}"
    say(f"sampling: Poisson q = {job.q:.4g} (E[B] = {job.batches.expected_batch_size:g} "
        f"{'units' if args.data else 'documents'}), {physical}")
    if job.unpacked_why:
        say(f"not packed: {job.unpacked_why}")
    how = "given" if args.sigma is not None else f"calibrated for ε = {args.target_epsilon:g} over {args.steps} steps"
    if args.delta is None:
        why = f"{DELTA_RULE} for N = {N} {'units' if args.data else 'documents'}, well below 1/N = {1 / N:.3g}"
    else:
        why = "given" + ("" if job.delta < 1 / N else f"; NOT below 1/N = {1 / N:.3g}: a mechanism that releases "
                         "one whole document with probability δ would satisfy this guarantee")
    say(f"privacy: σ = {job.sigma:.4g} ({how}), δ = {job.delta:.3g} ({why}), C = {args.max_grad_norm:g}, "
        f"{args.clipping} clipping, {args.accountant.upper()} accountant, ε {job.unit}")
    E = job.batches.expected_batch_size
    if job.sigma >= E:
        say(f"WARNING: σ = {job.sigma:.4g} >= E[B] = {E:g}: the noise on each coordinate of the averaged gradient "
            f"(σC/E[B]) is at least the bound C on the whole clipped gradient's norm, so the model will learn little "
            "or nothing; a larger --target-epsilon or --expected-batch-size, or fewer --steps, lowers it")
    if args.insecure_seed is not None:
        say(f"WARNING: --insecure-seed {args.insecure_seed}: the DP noise and the Poisson sampling are derived from a "
            "public seed; anyone who knows it can regenerate the noise and subtract it. NO privacy guarantee holds "
            "for this run (tests only).")
    if job.start_step:
        say(f"resumed from {job.resumed_from} at step {job.start_step}/{args.steps}, ε so far "
            f"{job.engine.epsilon(job.delta):.3f}" + (" (the run had already finished)"
                                                       if job.start_step >= args.steps else ""))


def save_checkpoint(job: Job, step: int) -> None:
    """Rank 0 writes ckpt-<step>.pt atomically and keeps the newest --keep-checkpoints. With
    --fsdp every rank first writes its shards into the DCP folder ckpt-<step>.dcp/, which the
    .pt file (written last: a checkpoint is complete when it exists) names."""
    import torch.distributed as dist

    import longshield_fx as lf

    folder = checkpoint_dir(job.run_dir)
    if job.fsdp:
        dcp_name = f"ckpt-{step:08d}.dcp"
        # The ledger is written once the shards are (before the .pt that names them, below): a save
        # cut by a kill leaves a DCP folder no load reads, whose steps a restart redraws freely.
        lf.save_checkpoint(folder / dcp_name, job.engine, job.opt, job.batches, run_dir=None)
        dist.barrier()
        held = {"dcp": dcp_name, "model": None, "optimizer": None, "sampler": None, "engine": None}
    elif job.rank0:
        held = {"model": job.model.state_dict(), "optimizer": job.opt.state_dict(),
                "sampler": job.batches.state_dict(), "engine": job.engine.state_dict()}
    if not job.rank0:
        return
    state = {  # SECRET: the sampler's state holds the sampling key
        "format": CHECKPOINT_FORMAT, "complete": True, "step": step, "signature": job.signature,
        "args": saved_flags(job.args),
        **held, "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if job.device.type == "cuda" else None,
        "tokens": job.tokens_seen, "elapsed_s": job.elapsed_before + (time.time() - job.t_loop),
    }
    # Into the ledger once the file is whole and before it takes its name: a save cut by a kill is
    # a temp file no load reads, and a restart redraws its steps freely.
    atomic_save(state, folder / f"ckpt-{step:08d}.pt",
                before_replace=lambda: job.ledger.record(job.engine, job.batches, "checkpoint"))
    for _, old in list_checkpoints(folder)[job.args.keep_checkpoints:]:
        old.unlink(missing_ok=True)
        shutil.rmtree(old.with_suffix(".dcp"), ignore_errors=True)
