"""The training loop of ``longshield-fx train`` (and ``audit``), and stopping it between steps.

Per logical batch: accumulate this rank's physical batches, finalize (noise once, q from the
sampler), step AdamW, write one metrics row (with the held-out loss every --eval-every
steps), checkpoint every --save-every steps. Losses, timings and counts come from private
data without noise: they go only under ``not_covered_by_dp``.

Ctrl-C (SIGINT) or SIGTERM during a step lets the step finish, then saves a checkpoint of it and
exits (130 or 143): the same command continues from there. A second one stops at once (the step
in flight is lost, never saved half-done). Under torchrun every rank reports at every step
boundary whether it was signalled (one all-reduced flag), so all ranks stop after the same step
even when the signal reaches them at different steps.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time

import torch

from ..losses import packed_predicted_tokens
from .checkpoints import checkpoint_dir, list_checkpoints, save_checkpoint
from .common import say
from .corpus import NOT_COVERED
from .job import Job

_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal, as a shell reports it


class _StopRequests:
    """SIGINT and SIGTERM handlers for the loop's duration: the first signal is noted (the step
    runs on), a second one raises KeyboardInterrupt at once. Outside the loop (loading, compiling)
    the handlers are the ones before it, so Ctrl-C there stops at once."""

    def __init__(self):
        self.signum = None
        self._before = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers can be set there only
            for s in _EXIT:
                self._before[s] = signal.signal(s, self._note)
        return self

    def __exit__(self, *exc):
        for s, handler in self._before.items():
            signal.signal(s, handler)

    def _note(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        say(f"\n{signal.Signals(signum).name}: stopping after this step, with a checkpoint (again to stop at "
            "once, losing the step in flight)", file=sys.stderr)

    def agreed(self, job: Job) -> int | None:
        """The signal to stop on, the same on every rank: each rank's request, all-reduced."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.signum
        device = job.device if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor([self.signum or 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None


def run_steps(job: Job) -> int | None:
    """Every remaining logical batch of the sampler, with a progress bar on rank 0. Returns None
    when the run reached --steps, else the exit status of a stop asked for by a signal."""
    try:
        with _StopRequests() as stop:
            return _steps(job, stop)
    except KeyboardInterrupt:  # a second signal, or one outside the handlers: the step in flight is lost
        newest = list_checkpoints(checkpoint_dir(job.run_dir))
        say(f"interrupted after step {job.batches.step - 1}; "
            + (f"the newest checkpoint is {newest[0][1].name}: continue with the same command, or "
               f"longshield-fx train --resume {job.run_dir}" if newest else
               "no checkpoint was written yet (--save-every): the same command starts the run over"),
            file=sys.stderr)
        raise


def _steps(job: Job, stop: _StopRequests) -> int | None:
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
            job.steps_run += 1
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            saved = bool(args.save_every) and (step % args.save_every == 0 or step == args.steps)
            if saved:
                save_checkpoint(job, step)
            loss = row[NOT_COVERED]["train_loss"]
            last_loss = loss if loss is not None else last_loss
            if job.rank0:
                bar.set_postfix_str(f"ε={row['epsilon']:.2f} {job.unit.split(' (')[0]} (δ={job.delta:.3g}, "
                                    f"{args.accountant.upper()}) loss(not DP)="
                                    f"{'-' if last_loss is None else f'{last_loss:.3f}'}", refresh=False)
            bar.update()
            signum = stop.agreed(job) if step < args.steps else None
            if signum is not None:
                bar.close()
                return _stop_after(job, step, signum, saved)
    bar.close()
    return None


def _stop_after(job: Job, step: int, signum: int, saved: bool) -> int:
    """Step ``step`` is whole (its metrics row written): checkpoint it unless it just was (with
    --save-every 0 nothing is saved, as asked), say how to continue, return the exit status."""
    if not saved and job.args.save_every:
        save_checkpoint(job, step)  # every rank: a sharded (--fsdp) save is collective
    newest = list_checkpoints(checkpoint_dir(job.run_dir))
    how = (f"checkpoint {newest[0][1].name}: the same command continues from step {newest[0][0]}, or "
           f"longshield-fx train --resume {job.run_dir}") if newest else \
        "no checkpoint (--save-every 0): the same command starts the run over"
    say(f"stopped by {signal.Signals(signum).name} after step {step}/{job.args.steps}; {how}", file=sys.stderr)
    return _EXIT[signum]


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
            stats[1] += packed_predicted_tokens(labels, positions, units)
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
    ``batch_size`` rows a call, dropout off, then back to training mode. Computed without noise:
    NOT covered by ε."""
    import math

    model.eval()
    # Each row is a causal sequence of its own, so the rows that predict a token are evaluated
    # alone, batch_size rows at a time: a unit's rows of padding cost nothing, and the logits of
    # a call (which the training step never holds whole) are those of batch_size rows.
    ids, labels = docs.ids.flatten(0, -2), docs.labels.flatten(0, -2)
    predicts = (labels[:, 1:] != -100).any(1)
    ids, labels = ids[predicts], labels[predicts]
    loss, tokens = 0.0, 0
    for i in range(0, len(ids), batch_size):
        part = labels[i:i + batch_size].to(device)
        loss += float(model(ids[i:i + batch_size].to(device), part).double().sum())
        tokens += int((part[:, 1:] != -100).sum())
    model.train()
    mean = loss / max(tokens, 1)
    return {"eval_loss": mean, "eval_perplexity": math.exp(min(mean, 700.0)), "eval_tokens": tokens}


