"""A Hugging Face ``Trainer`` that trains with DP-SGD through longshield_fx.

A script written for ``transformers.Trainer`` becomes differentially private by swapping the class
and adding the privacy settings::

    from longshield_fx.hf import DPTrainer, PrivacyArguments

    trainer = DPTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=held_out,
                        data_collator=default_data_collator,
                        privacy=PrivacyArguments(target_epsilon=8.0, expected_batch_size=64))
    trainer.train()

Why a subclass (a mixin, so that TRL's ``SFTTrainer`` gets the same): the Trainer's loop (progress
bar, logging, callbacks, evaluation, checkpoint folders, the optimizer and LR schedule from
``TrainingArguments``) is kept; only the pieces that DP changes are replaced. Each optimizer step is
one Poisson-sampled logical batch of the training set's units (a row, or all rows of one value of
``PrivacyArguments.unit_column``), cut into fixed-shape physical batches of
``per_device_train_batch_size`` units (packed: of that many rows, a logical batch's last ones of
fewer); the engine accumulates their clipped per-unit gradients and adds the noise once. The
Trainer's own DataLoader, gradient clipping and model wrapping (DDP) are not used. Under torchrun
the processes form a (dp, cp) mesh (``PrivacyArguments.cp``, ``fsdp``).

What is logged: ``epsilon`` and ``delta`` beside every log line. The training loss is computed from
the private rows without noise, so it is logged as ``loss_not_dp`` (and ``train_loss_not_dp``);
``grad_norm`` is the norm of the released, noised gradient (covered by ε). Evaluation runs on the
held-out set, which is never trained on and which ε does not protect.

The package: ``arguments`` (``PrivacyArguments``, the refused ``TrainingArguments``), ``trainer``
(``DPTrainerMixin``), and its bases ``batches`` (the training set as physical batches) and
``checkpoints`` (saving and resuming, with the run ledger).
"""
from __future__ import annotations

import transformers

from .arguments import PrivacyArguments
from .trainer import DPTrainerMixin

__all__ = ["DPTrainer", "DPTrainerMixin", "DPSFTTrainer", "PrivacyArguments"]


class DPTrainer(DPTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with DP-SGD (``DPTrainerMixin``)."""


def __getattr__(name: str):
    if name == "DPSFTTrainer":  # trl is imported only when asked for
        import trl

        class DPSFTTrainer(DPTrainerMixin, trl.SFTTrainer):
            """TRL's ``SFTTrainer`` with DP-SGD (``DPTrainerMixin``): each example of the prepared dataset
            (a text, or a conversation through the chat template) is one privacy unit."""

        DPSFTTrainer.__module__ = __name__
        globals()[name] = DPSFTTrainer
        return DPSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
