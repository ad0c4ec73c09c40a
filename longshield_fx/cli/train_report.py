"""The closing report of ``longshield-fx train``: the model (also in Hugging Face format for HF
models), ``privacy.json``, the loss-vs-ε plot and ``summary.json``, and the lines printed.

Timings count the steps this process ran (a resumed run's earlier sessions are not in them), and
a run that had already finished is reported, not rewritten: its outputs stay as its last session
wrote them.
"""
from __future__ import annotations

import json
import time

from .checkpoints import atomic_save, checkpoint_dir
from .common import say
from .corpus import NOT_COVERED, PRIVACY_UNIT
from .job import Job, sampling_choice
from ..run_core import DELTA_RULE, SAMPLE_RATE_CHOSEN, SAMPLE_RATE_DERIVED


def plot_title(model_name: str, T: int, sampling: dict, sigma: float, unit: str = PRIVACY_UNIT) -> str:
    """``sampling``: the user's own flag (``train.sampling_choice``), never the value derived from N."""
    chosen = f"q={sampling['sample_rate']:g}" if "sample_rate" in sampling else f"E[B]={sampling['expected_batch_size']:g}"
    return f"{model_name}, T={T}, {chosen}, σ={sigma:.3g}\nε {unit}\nlosses: NOT covered by DP (no noise)"


def _fmt_time(s: float) -> str:
    """Seconds to a tenth, as 59.9s or 2m00.0s (rounded once, so 119.96 s is not 1m60.0s)."""
    minutes, tenths = divmod(round(s * 10), 600)
    return f"{minutes}m{tenths / 10:04.1f}s" if minutes else f"{tenths / 10:.1f}s"


def _private(row: dict) -> dict:
    return row.get(NOT_COVERED) or {}


def _loss_summary(rows: list[dict]) -> tuple[dict, int, float, float]:
    """(first/last losses and non-finite count, k, mean of the first k, mean of the last k)."""
    losses = [_private(r)["train_loss"] for r in rows if _private(r).get("train_loss") is not None]
    k = min(5, max(1, len(losses) // 2))
    first = sum(losses[:k]) / k if losses else float("nan")
    last = sum(losses[-k:]) / k if losses else float("nan")
    out = {"train_loss_first": losses[0] if losses else None, "train_loss_last": losses[-1] if losses else None,
           f"train_loss_first{k}_mean": first, f"train_loss_last{k}_mean": last,
           "nonfinite_samples": sum(_private(r).get("nonfinite_samples", 0) for r in rows)}
    return out, k, first, last


def session(job: Job) -> dict:
    """What this process did to the run: public step counts, no timing."""
    return {"started_at_step": job.start_step, "steps_run": job.steps_run, "resumed": job.start_step > 0,
            "already_finished": job.start_step >= job.args.steps}


def summary(job: Job, eps: float, loop: float, wall: float, startup: float) -> dict:
    """summary.json: what ε covers at the top, everything from private data under not_covered_by_dp.
    The timings are this process's: ``s_per_step`` over the ``session.steps_run`` steps it ran."""
    args = job.args
    private, _, _, _ = _loss_summary(job.rows)
    c = job.corpus.stats()
    private.update({
        # timings trace the batch sizes; a resumed run's earlier sessions are in training_s_all_sessions only
        "wall_s": round(wall, 2), "training_s": round(loop, 2),
        "s_per_step": round(loop / job.steps_run, 4) if job.steps_run else None,
        "training_s_all_sessions": round(job.elapsed_before + loop, 2),
        "startup_s": round(startup, 2),  # loading the corpus takes time in proportion to it
        "corpus": {**c, "data": args.data} if args.data else {"documents": job.corpus.num_units, **c},
        "expected_batch_size": job.batches.expected_batch_size,  # q·N
    })
    if job.packed:
        padding, slots, rows, pieces = job.packing
        private["packing"] = {"unit_slots": job.unit_slots, "rows_per_physical_batch": job.batches.physical_batch_size,
                              "padding_fraction": round(padding / slots, 6) if slots else None,
                              "pieces_per_row": round(pieces / rows, 3) if rows else None,
                              "padding_fraction_unpacked": c["padding_fraction"]}
    if job.eval_set is not None:
        private["eval"] = {**job.eval_set.stats(), **{k: v for k, v in _private(job.rows[-1]).items()
                                                        if k.startswith("eval_")}} if job.rows else job.eval_set.stats()
    if args.log_private_stats:
        private["tokens"] = job.tokens_seen
        private["tokens_per_s"] = job.rows[-1][NOT_COVERED].get("tokens_per_s") if job.rows else None
    return {
        "steps": args.steps, "resumed_from": job.start_step or None, "session": session(job),
        "privacy_unit": job.unit.removeprefix("per "), "epsilon": eps, "delta": job.delta,
        "delta_rule": DELTA_RULE if args.delta is None else "given", "accountant": args.accountant,
        "target_epsilon": None if args.sigma is not None else args.target_epsilon, "sigma": job.sigma,
        # q is public (ε needs it); a chosen E beside a derived q would give N: E is under NOT_COVERED
        "sample_rate": job.q, "sample_rate_source": SAMPLE_RATE_CHOSEN if args.sample_rate is not None else SAMPLE_RATE_DERIVED,
        "max_grad_norm": args.max_grad_norm, "insecure_seed": args.insecure_seed,
        "privacy_void": args.insecure_seed is not None, "init_seed": args.seed, "seq_len": args.seq_len,
        "max_files": None if args.data else args.max_files,
        "parameters": sum(p.numel() for p in job.model.parameters()),
        NOT_COVERED: private,
    }


def privacy_record(job: Job) -> dict:
    """privacy.json: the guarantee of the released model (``run_core.privacy_record``)."""
    from ..run_core import privacy_record as record

    args = job.args
    return record(job.engine, delta=job.delta, delta_given=args.delta is not None, unit=job.unit.removeprefix("per "),
                  sample_rate=job.q, sample_rate_chosen=args.sample_rate is not None, model=job.model,
                  insecure_seed=args.insecure_seed, final=True,
                  not_covered="losses, timings and counts in metrics.jsonl and summary.json come from the data without "
                              "noise; held-out evaluation documents are never trained on and are not protected by ε",
                  lora=job.model_desc.get("lora"))


def _write_outputs(job: Job, summary_: dict) -> str:
    """Rank 0: final model (and its Hugging Face folder), privacy.json, the loss-vs-ε plot,
    summary.json; returns the list of written files."""
    from ..tools.plots import loss_vs_epsilon

    from ..run_core import write_privacy_record

    job.ledger.record(job.engine, job.batches, "final model")
    final = job.run_dir / "final_model.pt"
    atomic_save(job.model.state_dict(), final)
    written = [str(job.metrics_path)]
    if job.model_desc["kind"].startswith("hf"):
        from .models import save_hf_model

        what = save_hf_model(job.model.lm, job.tokenizer, job.run_dir / "model", job.args.lora_save)
        written.append(f"{job.run_dir / 'model'} ({what}, Hugging Face format)")
    privacy = write_privacy_record(job.run_dir, privacy_record(job))
    png = loss_vs_epsilon([{"epsilon": r["epsilon"], "loss": _private(r).get("train_loss"),
                            "eval_loss": _private(r).get("eval_loss")} for r in job.rows],
                          job.run_dir / "loss_vs_epsilon.png",
                          title=plot_title(job.model_name, job.args.seq_len, sampling_choice(job.args),
                                           job.sigma, job.unit))
    summary_path = job.run_dir / "summary.json"
    summary_path.write_text(json.dumps(summary_, indent=1) + "\n")
    return ", ".join(written + [str(privacy), str(png), str(final), str(summary_path),
                                str(job.run_dir / "signature.json")])


def finish(job: Job) -> int:
    args = job.args
    wall, loop = time.time() - job.t_start, time.time() - job.t_loop
    startup = job.t_loop - job.t_start
    if job.fsdp:  # every rank takes part in gathering the whole model, which rank 0 writes
        job.engine.sharding.unshard_model(job.model)
    if not job.rank0:  # rank 0 accounts, writes and reports: no other rank loads dp_accounting and scipy
        return 0
    eps = job.engine.epsilon(job.delta)
    if job.steps_run == 0 and _outputs_written(job):
        say(f"the run in {job.run_dir} had already finished (step {job.start_step}/{args.steps}): nothing was "
            "trained and its outputs are left as its last session wrote them")
        _say_privacy(job, eps)
        return 0
    summary_ = summary(job, eps, loop, wall, startup)
    written = _write_outputs(job, summary_)
    _report_lines(job, summary_, loop, wall, startup)
    _say_privacy(job, eps)
    say(f"wrote {written}" + (f", checkpoints in {checkpoint_dir(job.run_dir)} (SECRET: the sampling key)"
                              if args.save_every else ""))
    return 0


def _outputs_written(job: Job) -> bool:
    """A finished session's outputs are all there (a session killed while writing them left some out)."""
    try:
        done = json.loads((job.run_dir / "summary.json").read_text()).get("steps") == job.args.steps
    except (OSError, ValueError):
        return False
    return done and all((job.run_dir / name).is_file() for name in ("final_model.pt", "privacy.json"))


def _report_lines(job: Job, summary_: dict, loop: float, wall: float, startup: float) -> None:
    args, n = job.args, job.steps_run
    _, k, first, last = _loss_summary(job.rows)
    private = summary_[NOT_COVERED]
    speed = f"{loop / n:.2f} s/step" if n else "no step run"
    speed += " (timings trace the batch sizes: NOT covered by DP)"
    if args.log_private_stats and private.get("tokens_per_s") is not None:
        speed += f", {private['tokens_per_s']:.0f} tokens/s (NOT covered by DP)"
    what = f"{args.steps} steps" if not job.start_step else \
        f"steps {job.start_step + 1}-{args.steps} of {args.steps} (resumed at step {job.start_step}; " \
        f"{_fmt_time(job.elapsed_before + loop)} of training over every session)"
    if not n:
        what = f"no step (the run had already finished at step {job.start_step}; its outputs were missing)"
    say(f"done: {what} in {_fmt_time(wall)} (startup {_fmt_time(startup)}, training {_fmt_time(loop)}), {speed}")
    say(f"training loss/token (NOT covered by DP): {first:.3f} -> {last:.3f} (mean of the first/last {k} non-empty "
        f"steps); non-finite per-sample gradients (NOT covered by DP): {private['nonfinite_samples']}")
    if "packing" in private and private["packing"]["padding_fraction"] is not None:
        pk = private["packing"]
        pieces = "no row held a document" if pk["pieces_per_row"] is None else \
            f"{pk['pieces_per_row']:.2f} pieces of documents per row"  # None: every draw was empty
        say(f"packing (NOT covered by DP): {pk['padding_fraction']:.1%} of the token slots computed were padding "
            f"({pk['padding_fraction_unpacked']:.1%} with --no-pack), {pieces}")
    if "eval" in private and "eval_loss" in private["eval"]:
        e = private["eval"]
        say(f"held-out loss/token (NOT covered by DP): {e['eval_loss']:.3f}, perplexity {e['eval_perplexity']:.2f} "
            f"({e['eval_tokens']} tokens of {e['units']} held-out units)")


def _say_privacy(job: Job, eps: float) -> None:
    args, budget = job.args, ""
    if args.sigma is None:
        budget = f" <= target {args.target_epsilon:g}" if eps <= args.target_epsilon else \
            f" > target {args.target_epsilon:g}!"
    say(f"privacy: ε = {eps:.3f} {job.unit}, δ = {job.delta:.3g}, {args.accountant.upper()} accountant{budget} "
        f"(σ = {job.sigma:.4g}, q = {job.q:.4g}, {args.steps} steps)"
        + (f"; VOID: --insecure-seed {args.insecure_seed} made the noise and the sampling public"
           if args.insecure_seed is not None else ""))
