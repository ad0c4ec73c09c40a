"""Before ``longshield-fx train`` compiles anything: the flags checked, the run folder claimed (a
run continues its own checkpoints, refuses another run's), the data loaded, σ decided (given,
calibrated, or the resumed checkpoint's) and the run ledger consulted; then the run folder opened."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .checkpoints import PER_SESSION, checkpoint_dir, jsonable, list_checkpoints, load_latest, resolve_resume, \
    signature_diff
from .common import CLIError, check_seq_len, say
from .corpus import stdlib_corpus
from .job import Job, sampling_choice
from .models import check_model_flags
from .train_data import check_data_args, data_signature, load_documents_for
from ..run_core import default_delta

_OUTPUTS = ("metrics.jsonl", "summary.json", "privacy.json", "final_model.pt", "signature.json")


def claim_run_dir(job: Job) -> None:
    """The run dir belongs to one run. With --resume, take the run's own flags from its newest
    checkpoint (a differing flag given here is refused by name). Without, a run dir that already
    holds checkpoints is continued when they are this command's run (checked by signature in
    ``decide_sigma``); one that holds outputs but no checkpoint is refused unless its signature
    is this command's (a run stopped before its first checkpoint starts over)."""
    args = job.args
    if args.resume:
        job.checkpoint = load_latest(job.ckpt_folder)
        _continue_in_out_folder(job)
        _take_saved_flags(args, job.checkpoint[0].get("args") or {})
        job.explicit_resume = True
        return
    if list_checkpoints(checkpoint_dir(job.run_dir)):
        job.resumed_run, job.ckpt_folder = job.run_dir, checkpoint_dir(job.run_dir)
        return
    held = [name for name in _OUTPUTS if (job.run_dir / name).exists()]
    if held:
        job.restart_if_same = held


def _continue_in_out_folder(job: Job) -> None:
    """``--resume OLD --out NEW``: where NEW already holds checkpoints, they are this run's (a
    session of this very command went on there, and a restart repeats the command), so the run
    continues from the newer of the two folders; another run's checkpoints in NEW are refused."""
    own = checkpoint_dir(job.run_dir)
    if own.resolve() == job.ckpt_folder.resolve() or not list_checkpoints(own):
        return
    mine = load_latest(own)
    if mine[0].get("signature") != job.checkpoint[0].get("signature"):
        raise CLIError(f"--out {job.run_dir} holds checkpoints of another run than --resume {job.args.resume} "
                       "(their data, model or flags differ): give a new --out to continue the resumed run there")
    if mine[0]["step"] > job.checkpoint[0]["step"]:
        job.checkpoint, job.ckpt_folder = mine, own


def _take_saved_flags(args, saved: dict) -> None:
    given = _given_flags(args)
    differing = [f"--{dest.replace('_', '-')} {getattr(args, dest)!r} (the run has {value!r})"
                 for dest, value in saved.items()
                 if dest in given and dest not in PER_SESSION and jsonable(getattr(args, dest)) != value]
    if differing:
        raise CLIError(f"--resume {args.resume}: " + "; ".join(differing)
                       + (": this flag differs" if len(differing) == 1 else ": these flags differ")
                       + " from the run being resumed: drop them to continue it with its own flags, or start a new "
                       "run with a new --out")
    for dest, value in saved.items():
        if dest not in given and dest not in PER_SESSION and hasattr(args, dest):
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




def check_args(job: Job) -> None:
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


def fsdp_dims(text: str | None, mesh) -> tuple[str, ...] | None:
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


def load_corpus(job: Job) -> None:
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


def decide_sigma(job: Job) -> dict | None:
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


def read_metrics(path: Path, upto: int | None = None) -> list[dict]:
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


def open_run_dir(job: Job) -> None:
    """Keep the metrics of the steps before the checkpoint (lines a killed run wrote after it
    are dropped); write the signature."""
    if job.start_step:
        job.rows = read_metrics((job.resumed_run or job.run_dir) / "metrics.jsonl", upto=job.start_step)
    if not job.rank0:
        return
    job.run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir(job.run_dir).mkdir(exist_ok=True)
    tmp = job.metrics_path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in job.rows))
    os.replace(tmp, job.metrics_path)
    (job.run_dir / "signature.json").write_text(json.dumps(job.signature, indent=1) + "\n")


