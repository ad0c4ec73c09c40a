"""``longshield-fx train`` from its decided σ to its first step: the engine compiled (packed or
one unit per padded block), AdamW and the sampler built, a checkpoint's state restored, and the
run announced (model, data, sampling, privacy)."""
from __future__ import annotations

import torch

from .common import CLIError, say
from .job import Job
from ..run_core import DELTA_RULE


def compile_run(job: Job, dataset=None) -> None:
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
    """Packed documents: physical batches of B·R rows (the memory of B padded units:
    ``packing.packed_rows``), a logical batch's last ones of half as many, a quarter, ...;
    holding up to ``packing.unit_slots_per_row(T)`` units per row and at most 2·E + 8
    (``packing.unit_slots_for``); Poisson sampling over units (``packing.PackedPoissonBatches``).
    Each row count's graph is captured here, before the first step, the fewest rows' on random
    documents, so that the isolation probe runs (``packing.capture_every_row_count``)."""
    import longshield_fx as lf

    from ..errors import UnsupportedModelError
    from ..packing import PackedPoissonBatches, capture_every_row_count, packed_rows, unit_slots_for

    args = job.args
    rows = packed_rows(job.corpus.rows_per_unit, args.physical_batch_size)
    job.unit_slots = unit_slots_for(rows, args.seq_len, job.q * job.corpus.num_units)
    job.engine = lf.compile(lf.PackedCausalLMLoss(job.model.lm), job.mesh, config=config, checkpoint=checkpoint,
                            fsdp=job.fsdp, packed_units=job.unit_slots)
    try:
        capture_every_row_count(job.engine, job.model.lm, rows, args.seq_len, job.unit_slots, job.device)
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


def restore(job: Job, state: dict) -> None:
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


def announce(job: Job) -> None:
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
    if job.packed:
        from ..packing import row_counts

        rows, *fewer = row_counts(job.batches.physical_batch_size)
        physical = (f"packed into physical batches of {rows} rows x {T}"
                    + (f" (a logical batch's last ones of {' or '.join(map(str, fewer))} rows)" if fewer else "")
                    + f" holding up to {job.unit_slots} units each (--no-pack: {args.physical_batch_size} units "
                    "of padded rows)")
    else:
        physical = f"physical batch {args.physical_batch_size}"
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


