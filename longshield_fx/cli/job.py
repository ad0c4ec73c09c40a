"""One run of ``longshield-fx train`` (or ``audit``): the ``Job`` every step of the run fills in,
and the user's sampling choice as the outputs publish it."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .common import rank
from .corpus import PRIVACY_UNIT


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
    steps_run: int = 0                   # steps this process ran (what its timings count)
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



def sampling_choice(args) -> dict:
    """The user's sampling flag: q itself when chosen (public), else E (q = E/N is derived)."""
    if args.sample_rate is not None:
        return {"sample_rate": args.sample_rate}
    return {"expected_batch_size": args.expected_batch_size}

