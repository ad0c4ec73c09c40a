"""Saving and resuming a ``DPTrainer`` run: the engine's state in every checkpoint folder, and
the run ledger that refuses an older checkpoint unless the run forks."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
import transformers

import longshield_fx as lf

from ..run_core import RunLedger, write_privacy_record

FORK_HINT = "pass PrivacyArguments(fork=True)"
ENGINE_FOLDER = "longshield"  # in each checkpoint-N folder: model, optimizer, accountant, sampler (SECRET)


def _inner(optimizer):
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


class LedgerCheckpointsMixin:
    """A base of ``DPTrainerMixin``: checkpoint folders with the engine's state (model, optimizer,
    accountant, sampler), each release recorded in the run ledger first."""

    def _check_ledger(self, checkpoint) -> None:
        """Before anything is loaded: a checkpoint older than the run ledger's newest step (in
        ``output_dir``, or beside the checkpoint) is refused unless ``PrivacyArguments.fork``."""
        if checkpoint is True:
            checkpoint = transformers.trainer_utils.get_last_checkpoint(self.args.output_dir)
            if checkpoint is None:
                return  # the Trainer says there is none
        state = Path(checkpoint) / transformers.trainer.TRAINER_STATE_NAME
        try:
            step = int(json.loads(state.read_text())["global_step"])
        except (OSError, ValueError, KeyError):
            return  # not a Trainer checkpoint: the load says so
        RunLedger(self.args.output_dir, Path(checkpoint).parent).refuse_older(
            step, fork=self.privacy.fork, where="DPTrainer", what=str(checkpoint), fork_hint=FORK_HINT)

    def _whole_parameters(self):
        """Under fsdp, the model with every parameter gathered whole (a collective: every rank is
        here, as the Trainer calls save and evaluate on every rank)."""
        if self.engine is None or self.engine.sharding is None:
            return contextlib.nullcontext()
        return self.engine.sharding.whole_parameters(self.engine.model)

    def _record(self, why: str) -> None:
        """The steps taken since the last record go into the run ledger (main process), before
        anything derived from them leaves."""
        if self.engine is not None and self.is_world_process_zero():
            self._ledger.record(self.engine, self._sampler, why)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        self._record("model saved")
        super()._save(output_dir, state_dict)
        if self.engine is not None and self.args.should_save:
            folder = Path(output_dir if output_dir is not None else self.args.output_dir)
            final = not folder.name.startswith(transformers.trainer_utils.PREFIX_CHECKPOINT_DIR)
            write_privacy_record(folder, self.privacy_record(final=final))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self._record("checkpoint")
        lf.save_checkpoint(Path(output_dir) / ENGINE_FOLDER, self.engine, _inner(self.optimizer), self._sampler,
                           run_dir=None)  # recorded just above, in every folder of the run's ledger
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        folder = Path(checkpoint) / ENGINE_FOLDER
        if not folder.is_dir():
            raise ValueError(f"DPTrainer: {checkpoint} has no {ENGINE_FOLDER}/ folder (a DPTrainer checkpoint holds "
                             "the accountant and the sampler; save_only_model=True leaves them out); resume from a "
                             "checkpoint folder a DPTrainer wrote with save_only_model=False")
        self._ledger = RunLedger(self.args.output_dir, Path(checkpoint).parent)
        self._ledger.sync()  # load_checkpoint reads output_dir's ledger: it holds both folders' steps
        lf.load_checkpoint(folder, self.engine, _inner(self.optimizer), self._sampler, fork=self.privacy.fork,
                           run_dir=self.args.output_dir)  # train() refused an older checkpoint before any load
        self._draws = None
        scheduler = os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME)
        self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
