"""The training loop of ``longshield-fx train`` and its closing report.

Per logical batch: accumulate this rank's physical batches, finalize (noise once, q from the
sampler), step AdamW, write one metrics row (with the held-out loss every --eval-every
steps), checkpoint every --save-every steps. Losses, timings and counts come from private
data without noise: they go only under ``not_covered_by_dp``. At the end: the model (also in
Hugging Face format for HF models), ``privacy.json``, the plot and ``summary.json``.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch

from .checkpoints import atomic_save, checkpoint_dir
from .corpus import NOT_COVERED, PRIVACY_UNIT
from .common import say
from ..run_core import DELTA_RULE, SAMPLE_RATE_CHOSEN, SAMPLE_RATE_DERIVED
from .train import Job, sampling_choice, save_checkpoint


def run_steps(job: Job) -> None:
    """Every remaining logical batch of the sampler, with a progress bar on rank 0."""
    from tqdm import tqdm

    args = job.args
    job.t_loop = time.time()
    bar = tqdm(total=args.steps, initial=job.start_step, desc="train", disable=not job.rank0, unit="step",
               dynamic_ncols=True, file=sys.stderr)
    last_loss = None
    with open(job.metrics_path, "a") if job.rank0 else open(os.devnull, "w") as metrics:
        for logical in (job.batches if job.start_step < args.steps else []):
            step = job.batches.step
            try:
                row = _one_step(job, logical, step)
            except RuntimeError as e:  # a collective that timed out (init_process_group's timeout), or any other
                raise RuntimeError(f"step {step}: {e}") from e
            if job.eval_set is not None and (step % args.eval_every == 0 or step == args.steps):
                # The held-out loss is a function of the model, covered by ε: its steps leave with it. The
                # training loss of each metrics row is not covered (it reads the private batch unnoised).
                if job.rank0:
                    job.ledger.record(job.engine, job.batches, "evaluation")
                row[NOT_COVERED].update(_evaluate_on_rank0(job))
            job.rows.append(row)
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            if args.save_every and (step % args.save_every == 0 or step == args.steps):
                save_checkpoint(job, step)
            loss = row[NOT_COVERED]["train_loss"]
            last_loss = loss if loss is not None else last_loss
            if job.rank0:
                bar.set_postfix_str(f"ε={row['epsilon']:.2f} loss(not DP)="
                                    f"{'-' if last_loss is None else f'{last_loss:.3f}'}", refresh=False)
            bar.update()
    bar.close()


def _one_step(job: Job, logical, step: int) -> dict:
    """One logical batch: accumulate, finalize, optimizer step; returns its metrics row."""
    import torch.distributed as dist

    engine, dp = job.engine, job.dp
    mine = logical.share(job.dp_rank, dp)  # the same number of physical batches in every dp group
    nonfinite_before = engine.nonfinite_samples
    # loss sum, predicted tokens, real tokens of this rank's real rows, non-finite samples (NOT covered by DP)
    stats = torch.zeros(4, dtype=torch.float64)
    packing = torch.zeros(4, dtype=torch.float64)  # packed: padding slots, slots, rows used, pieces (NOT covered)
    for (ids, labels, *extra), mask in mine:  # extra: the audit's canary column; none in train
        if mask is None:  # packed: (ids, labels, positions, units); the unit slots say who is in it
            loss_sum = engine.accumulate(*(t.to(job.device) for t in (ids, labels, *extra)))
            positions, units = extra
            stats[0] += loss_sum.detach().double().cpu()
            stats[1] += int(((labels != -100) & (positions > 0)).sum())  # a piece's first token predicts nothing
            stats[2] += int((labels != -100).sum())
            packing += torch.tensor([int((units == job.unit_slots).sum()), units.numel(),
                                     int((units != job.unit_slots).any(1).sum()),
                                     int(((positions == 0) & (units != job.unit_slots)).sum())], dtype=torch.float64)
            continue
        real = mask.bool()
        loss_sum = engine.accumulate(ids.to(job.device), labels.to(job.device), *(t.to(job.device) for t in extra),
                                     mask=mask.to(job.device))
        stats[0] += loss_sum.detach().double().cpu()
        stats[1] += int((labels[real][..., 1:] != -100).sum())
        stats[2] += int((labels[real] != -100).sum())
    # cp ranks of a dp group count the same samples (norms are all-reduced over cp): sum over dp only
    stats[3] = engine.nonfinite_samples - nonfinite_before
    engine.finalize(logical)  # every dp rank, with the same logical batch: q and E[B] from the sampler
    if job.observe is not None:  # the audit reads the released gradient before the optimizer step
        job.observe(job, logical)
    job.opt.step()
    job.opt.zero_grad(set_to_none=True)
    if dp > 1:
        group = job.mesh["dp"].get_group()
        device = job.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        both = torch.cat([stats, packing]).to(device)
        dist.all_reduce(both, group=group)
        stats, packing = both.cpu().split(4)
    job.packing = [a + int(b) for a, b in zip(job.packing, packing.tolist())]
    job.tokens_seen += int(stats[2])
    elapsed = job.elapsed_before + time.time() - job.t_loop
    loss = float(stats[0]) / float(stats[1]) if stats[1] > 0 else None
    # elapsed_s too: each physical batch takes time, so per-step timings trace the batch sizes
    private = {"train_loss": loss, "nonfinite_samples": int(stats[3]), "elapsed_s": round(elapsed, 3)}
    if job.args.log_private_stats:
        private.update(logical_batch_size=logical.size, tokens=job.tokens_seen,
                       tokens_per_s=round(job.tokens_seen / max(elapsed, 1e-9), 1))
    # ε per step on rank 0 only, which writes the metrics: the others' accountants hold the same steps.
    return {"step": step, "epsilon": engine.epsilon(job.delta) if job.rank0 else None, "delta": job.delta,
            "sigma": job.sigma, NOT_COVERED: private}


def _evaluate_on_rank0(job: Job) -> dict:
    """The held-out metrics, computed by rank 0 ({} elsewhere). With --fsdp every rank takes
    part in gathering the whole model for the evaluation."""
    whole = job.engine.sharding.whole_parameters(job.model) if job.fsdp else contextlib.nullcontext()
    with whole:
        return evaluate(job.eval_model or job.model, job.eval_set, job.args.physical_batch_size, job.device) \
            if job.rank0 else {}


@torch.no_grad()
def evaluate(model, docs, batch_size: int, device) -> dict:
    """Per-token loss and perplexity of ``model`` (a ``CausalLMLoss``) on held-out documents,
    dropout off, then back to training mode. Computed without noise: NOT covered by ε."""
    import math

    model.eval()
    loss, tokens = 0.0, 0
    for i in range(0, docs.num_units, batch_size):
        ids, labels = docs.ids[i:i + batch_size].to(device), docs.labels[i:i + batch_size].to(device)
        loss += float(model(ids, labels).double().sum())
        tokens += int((labels[..., 1:] != -100).sum())
    model.train()
    mean = loss / max(tokens, 1)
    return {"eval_loss": mean, "eval_perplexity": math.exp(min(mean, 700.0)), "eval_tokens": tokens}


def plot_title(model_name: str, T: int, sampling: dict, sigma: float, unit: str = PRIVACY_UNIT) -> str:
    """``sampling``: the user's own flag (``train.sampling_choice``), never the value derived from N."""
    chosen = f"q={sampling['sample_rate']:g}" if "sample_rate" in sampling else f"E[B]={sampling['expected_batch_size']:g}"
    return f"{model_name}, T={T}, {chosen}, σ={sigma:.3g}\nε {unit}\nlosses: NOT covered by DP (no noise)"


def _fmt_time(s: float) -> str:
    return f"{int(s // 60)}m{s % 60:04.1f}s" if s >= 60 else f"{s:.1f}s"


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


def summary(job: Job, eps: float, loop: float, wall: float, startup: float) -> dict:
    """summary.json: what ε covers at the top, everything from private data under not_covered_by_dp."""
    args, done = job.args, max(1, job.args.steps - job.start_step)
    private, _, _, _ = _loss_summary(job.rows)
    c = job.corpus.stats()
    private.update({
        "wall_s": round(wall, 2), "s_per_step": round(loop / done, 4),  # timings trace the batch sizes
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
        "steps": args.steps, "resumed_from": job.start_step or None,
        "privacy_unit": job.unit.removeprefix("per "), "epsilon": eps, "delta": job.delta,
        "delta_rule": DELTA_RULE if args.delta is None else "given", "accountant": args.accountant,
        "target_epsilon": None if args.sigma is not None else args.target_epsilon, "sigma": job.sigma,
        "sample_rate": job.q, "sample_rate_source": SAMPLE_RATE_CHOSEN if args.sample_rate is not None else SAMPLE_RATE_DERIVED,
        **sampling_choice(args),
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
        from .hf import save_hf_model

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
    summary_ = summary(job, eps, loop, wall, startup)
    written = _write_outputs(job, summary_)
    _, k, first, last = _loss_summary(job.rows)
    private = summary_[NOT_COVERED]
    speed = f"{loop / max(1, args.steps - job.start_step):.2f} s/step (timings trace the batch sizes: NOT covered by DP)"
    if args.log_private_stats and private.get("tokens_per_s") is not None:
        speed += f", {private['tokens_per_s']:.0f} tokens/s (NOT covered by DP)"
    say(f"done: {args.steps} steps in {_fmt_time(wall)} (startup {_fmt_time(startup)}, training {_fmt_time(loop)}), "
        f"{speed}")
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
    budget = ""
    if args.sigma is None:
        budget = f" <= target {args.target_epsilon:g}" if eps <= args.target_epsilon else \
            f" > target {args.target_epsilon:g}!"
    say(f"privacy: ε = {eps:.3f} {job.unit}, δ = {job.delta:.3g}, {args.accountant.upper()} accountant{budget} "
        f"(σ = {job.sigma:.4g}, q = {job.q:.4g}, {args.steps} steps)"
        + (f"; VOID: --insecure-seed {args.insecure_seed} made the noise and the sampling public"
           if args.insecure_seed is not None else ""))
    say(f"wrote {written}" + (f", checkpoints in {checkpoint_dir(job.run_dir)} (SECRET: the sampling key)"
                              if args.save_every else ""))
    return 0
