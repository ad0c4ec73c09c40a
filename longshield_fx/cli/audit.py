"""``longshield-fx audit``: the training job of ``longshield-fx train``, run once with canaries,
and the claimed ε beside the empirical one-run lower bound (Steinke, Nasr and Jagielski 2023).

The run is train's (same flags, corpus, σ, sampler, loop: ``train_loop.run_steps``) with m
canaries, each included by a secret fair coin: white-box gradient canaries (an audit parameter
added to the model for this run only) or black-box random byte sequences. Nothing here runs in
``train``: the audit library is imported only by this command.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

from .checkpoints import checkpoint_dir
from .common import CLIError, Formatter, add_model_args, positive_int, say
from .job import Job
from .train import _optimizer_corpus_device_args, _privacy_args
from .train_build import announce, compile_run
from .train_data import add_data_args, build_model_for
from .train_loop import run_steps
from .train_setup import check_args, decide_sigma, load_corpus, open_run_dir

DESCRIPTION = (
    "Empirical privacy audit in one training run. Runs the job of 'longshield-fx train' (same flags:\n"
    "the embedded corpus or your --data, a reference model or your --model DIR / --hf-config, full or\n"
    "--lora; calibrated σ, Poisson sampling, DP-SGD loop; --data is not packed here) with --canaries m\n"
    "extra privacy units of one row each, each included\n"
    "independently with probability 1/2 by a secret coin, then guesses from what the run released\n"
    "which canaries were in and turns the right guesses into a lower bound on ε at --confidence\n"
    "(Steinke, Nasr and Jagielski, 'Privacy auditing with one training run', NeurIPS 2023; the best of\n"
    "14 guess sets fixed in advance, Bonferroni-corrected). Prints the claimed ε (the accountant's, at\n"
    "the job's δ) and the bound side by side.\n\n"
    "--kind white: gradient canaries. An audit parameter of m coordinates is added to the model for this\n"
    "run only; canary j's per-sample gradient is C times the j-th unit vector (at the clipping threshold,\n"
    "where no document has a gradient), scored from the released noisy gradient of that coordinate at\n"
    "every step (the likelihood ratio of Poisson-sampled against absent, from the public q and σ). It\n"
    "audits the engine's clipping, noise and sampling for any model.\n"
    "--kind black: random byte sequences of T bytes (every label random), scored by how much their loss\n"
    "fell during training: the whole pipeline as a user runs it, and a much weaker attack.\n\n"
    "A bound above the claimed ε means the run is less private than claimed (a bug); a bound below it\n"
    "proves nothing about the claim's tightness: one run with m canaries cannot show much more than\n"
    "ln(m) whatever the truth. The canaries are in this run's model only; 'train' never adds any.\n\n"
    "Writes to --out: audit.json (claimed ε, bound, the guesses behind it, the run's public settings),\n"
    "audit_scores.png (score histograms of included and excluded canaries), metrics.jsonl and\n"
    "signature.json as train does. No checkpoints and no final model: the audit's model holds canaries.")


def add_parser(sub) -> None:
    a = sub.add_parser("audit", formatter_class=Formatter, description=DESCRIPTION,
                       help="empirical ε lower bound from one training run with canaries")
    add_model_args(a, seq_len_default=2048)
    a.set_defaults(physical_batch_size=4, func=audit, resume=None, save_every=0, keep_checkpoints=1)
    _privacy_args(a)
    add_data_args(a)
    _optimizer_corpus_device_args(a)
    a.add_argument("--out", default="runs/audit", metavar="DIR", help="output directory")
    a.add_argument("--canaries", type=positive_int, default=1000, metavar="M",
                   help="canaries m; each is one extra row, included with probability 1/2")
    a.add_argument("--kind", choices=["white", "black"], default="white",
                   help="white: gradient canaries in an audit parameter; black: random byte sequences")
    a.add_argument("--confidence", type=_confidence, default=0.95, metavar="P",
                   help="confidence of the lower bound, in (0, 1)")


def _confidence(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def audit(args) -> int:
    """Validate, build the corpus, model and canaries, run train's loop, score, report."""
    from ..audit import draw_canaries

    if args.cp != 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise CLIError("audit runs in one process: drop --cp and torchrun")
    job = Job(args, time.time())
    check_args(job)
    _check_canary_memory(args.canaries, args.kind, args.seq_len)  # before the corpus: refuse, don't get killed
    load_corpus(job)
    _check_canaries(args, job.delta)
    build_model_for(job)
    if args.data and not args.no_pack:
        job.unpacked_why = "the audit's canaries are privacy units of their own rows"
    base = job.model
    _check_black_box_vocabulary(args, base)
    job.device = torch.device(args.device)
    base.to(job.device)
    # Drawn before training from their own secret stream (or --insecure-seed's, for tests).
    canaries = draw_canaries(args.canaries, args.kind, seq_len=args.seq_len, insecure_seed=args.insecure_seed)
    scoring = _Scoring(job, base, canaries)
    decide_sigma(job)
    scoring.start(job)
    open_run_dir(job)
    announce(job)
    say(f"audit: {canaries.m} {args.kind}-box canaries, each one extra privacy unit (one row) included by a secret fair coin; "
        f"the gradient divisor is the public E[B] = {job.batches.expected_batch_size:g} (counting m/2 canaries)")
    stopped = run_steps(job)
    if stopped is not None:  # a signal: no bound from part of a run
        return stopped
    return _report(job, canaries, scoring.finish())


def _check_black_box_vocabulary(args, model) -> None:
    """Black-box canaries are random bytes: token ids 0..255 must all be tokens of the model."""
    embeddings = model.lm.get_input_embeddings() if hasattr(model.lm, "get_input_embeddings") else None
    vocab = embeddings.num_embeddings if embeddings is not None else 256
    if args.kind == "black" and vocab < 256:
        raise CLIError(f"--kind black: the canaries are random bytes (token ids 0..255) but the model has {vocab} "
                       "tokens; use --kind white")


def _check_canaries(args, delta: float) -> None:
    """Before any training: with too few canaries no outcome of the run could give a bound."""
    from ..audit.bound import fewest_canaries

    fewest = fewest_canaries(delta, args.confidence)
    if args.canaries < fewest:
        raise CLIError(f"--canaries {args.canaries}: even all-correct guesses on so few canaries cannot refute any "
                       f"ε at --confidence {args.confidence:g}; use at least {fewest} (hundreds for a useful bound)")


# What one canary holds at the audit's peak, beyond its seq_len-long rows (bytes): its coin
# (1) and the int64 words drawing it (24: stream, shift, mask), its share of the canary
# index column (~8), the audit parameter's float32 value, gradient, clipped sum and two AdamW
# states (20), and the float64 score with the temporaries of one ``WhiteBoxScores.observe``
# (~40). Rounded up.
_CANARY_SCALAR_BYTES = 96
# The estimate counts the canaries only: the model, its optimizer states and activations, the
# corpus (which training_rows copies once) and allocator slack need room beside them, and
# MemAvailable is what the kernel could free, not what is free. So refuse at half of it.
_MEMORY_SAFETY = 2


def _canary_bytes(m: int, kind: str, seq_len: int) -> int:
    """Estimated peak bytes of m canaries (``draw_canaries``, ``training_rows``, the white-box
    parameter and scores). White-box: ~m/2 included canaries each become a copy of the null
    row, int64 ids and labels (16·T bytes); black-box: drawing the (m, T) int64 sequences
    peaks at three int64 words per token (stream, shift, mask: 24·T), above the ids (8·T)
    plus the ~m/2 included rows (8·T) that stay."""
    per_token = 8 if kind == "white" else 24
    return m * (per_token * seq_len + _CANARY_SCALAR_BYTES)


def _check_canary_memory(m: int, kind: str, seq_len: int, available: int | None = None) -> None:
    """Before the corpus and the canaries: refuse a count this machine cannot hold, in one line,
    rather than be killed for memory midway. ``available``: bytes (default: this machine's)."""
    need = _canary_bytes(m, kind, seq_len)
    available = _available_memory() if available is None else available
    if available is None or need * _MEMORY_SAFETY <= available:  # unknown: nothing to go by, let it run
        return
    fits = available // (_MEMORY_SAFETY * (need // m))
    raise CLIError(f"--canaries {m}: {kind}-box canaries at T={seq_len} need an estimated {need / 2 ** 30:,.1f} GiB "
                   f"({need:,} bytes; {_MEMORY_SAFETY}x that with room for the model and the run) but "
                   f"{available / 2 ** 30:,.1f} GiB of memory is available; use a smaller --canaries "
                   + (f"(at most {fits:,} here)" if fits else "(none fit here at this -T; lower -T)"))


def _available_memory() -> int | None:
    """Bytes of memory available to a new allocation: Linux's MemAvailable (counts the page
    cache it could drop), else the free physical pages; None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the value is in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class _Scoring:
    """The audit's model and dataset around ``base``, and the canaries' scores."""

    def __init__(self, job: Job, base, canaries):
        from ..audit import WhiteBoxCanaries

        self.base, self.canaries, self.white = base, canaries, canaries.kind == "white"
        job.model = WhiteBoxCanaries(base, canaries.m, job.args.max_grad_norm).to(job.device) if self.white else base
        self.before = self.recorder = None

    def start(self, job: Job) -> None:
        """Compile over the corpus plus the included canaries; have the loop hand over each
        step's released gradient (white-box) or score the canaries once before training."""
        from torch.utils.data import TensorDataset

        from ..audit import PublicDivisor, WhiteBoxScores, canary_losses, training_rows

        corpus = job.corpus
        null_row = (corpus.ids[0], torch.full_like(corpus.ids[0], -100))  # white-box rows: no token loss
        compile_run(job, TensorDataset(*training_rows((corpus.ids, corpus.labels), self.canaries, null_row)))
        job.batches = PublicDivisor(job.batches, job.q * (corpus.num_units + self.canaries.m / 2))
        job.eval_model = self.base  # held-out documents are scored without the audit parameter
        if self.white:
            self.recorder = WhiteBoxScores(self.canaries.m, noise_multiplier=job.sigma, sample_rate=job.q,
                                           max_grad_norm=job.args.max_grad_norm)
            job.observe = lambda job, logical: self.recorder.observe(job.model.canary_directions.grad,
                                                                    logical.expected_size)
        else:
            self.before = canary_losses(self.base, self.canaries.ids)

    def finish(self):
        """White-box: the summed log-likelihood ratios; black-box: loss before minus after."""
        from ..audit import canary_losses

        return self.recorder.scores if self.white else self.before - canary_losses(self.base, self.canaries.ids)


def _report(job: Job, canaries, scores) -> int:
    """The bound at the job's δ, printed beside the claimed ε; audit.json and the histogram."""
    from ..audit import AuditReport, audit_bound, write_report

    args = job.args
    included = canaries.included.numpy()
    claimed = job.engine.epsilon(job.delta)
    run = {"command": "longshield-fx audit", "privacy_unit": f"{job.unit}; a canary is one unit of its own",
           "noise_multiplier": job.sigma, "sample_rate": job.q, "steps": args.steps,
           "max_grad_norm": args.max_grad_norm, "clipping": args.clipping, "accountant": args.accountant,
           "documents": job.corpus.num_documents, "units": job.corpus.num_units, "seq_len": args.seq_len, "model": job.model_name,
           "expected_batch_size": job.batches.expected_batch_size, "insecure_seed": args.insecure_seed,
           "wall_s": round(time.time() - job.t_start, 1)}
    report = AuditReport(canaries.kind, claimed, audit_bound(scores, included, job.delta, args.confidence), scores,
                         included, run)
    summary, png = write_report(report, job.run_dir, title=f"{job.model_name}, T={args.seq_len}, σ={job.sigma:.3g}, "
                                f"q={job.q:.3g}, {args.steps} steps, {canaries.m} {canaries.kind}-box canaries")
    verdict = ("ABOVE the claimed ε: this run is less private than claimed" if report.bound.epsilon > claimed else
               "below the claimed ε: no violation found (a lower bound; it does not show the claim is tight)")
    say(f"audit: {report.line()}; {verdict}")
    say(f"privacy: ε = {claimed:.3f} {job.unit}, δ = {job.delta:.3g}, {args.accountant.upper()} accountant "
        f"(σ = {job.sigma:.4g}, q = {job.q:.4g}, {args.steps} steps)"
        + (f"; VOID: --insecure-seed {args.insecure_seed} made the noise, the sampling and the coins public"
           if args.insecure_seed is not None else ""))
    say(f"wrote {summary}, {png}, {job.metrics_path}")
    with contextlib.suppress(OSError):  # train's run directory comes with an empty checkpoints/: none here
        checkpoint_dir(job.run_dir).rmdir()
    return 0
