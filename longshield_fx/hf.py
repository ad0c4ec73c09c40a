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
``per_device_train_batch_size`` units; the engine accumulates their clipped per-unit gradients and
adds the noise once. The Trainer's own DataLoader, gradient clipping and model wrapping (DDP) are not
used. Under torchrun the processes form a (dp, cp) mesh (``PrivacyArguments.cp``, ``fsdp``).

What is logged: ``epsilon`` and ``delta`` beside every log line. The training loss is computed from
the private rows without noise, so it is logged as ``loss_not_dp`` (and ``train_loss_not_dp``);
``grad_norm`` is the norm of the released, noised gradient (covered by ε). Evaluation runs on the
held-out set, which is never trained on and which ε does not protect.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from torch.utils.data import DataLoader

import longshield_fx as lf

from .run_core import (RunLedger, calibrated_sigma, default_delta, privacy_record,
                       write_privacy_record)
from .data import LogicalBatch, PoissonBatches
from .losses import CausalLMLoss, PackedCausalLMLoss
from .packing import PackedPoissonBatches, unit_slots_for

__all__ = ["DPTrainer", "DPTrainerMixin", "DPSFTTrainer", "PrivacyArguments"]

_FORK_HINT = "pass PrivacyArguments(fork=True)"
ENGINE_FOLDER = "longshield"  # in each checkpoint-N folder: model, optimizer, accountant, sampler (SECRET)


@dataclass
class PrivacyArguments:
    """The DP settings of a ``DPTrainer`` (or ``DPSFTTrainer``) run.

    target_epsilon / noise_multiplier: exactly one. A target calibrates σ to the run's steps
        (``max_steps``, or ``num_train_epochs`` epochs of round(1/q) steps each).
    delta: δ of the reported (ε, δ); default the largest power of ten ≤ min(1e-5, N^-1.1).
    max_grad_norm: the per-row clipping threshold C (``TrainingArguments.max_grad_norm`` is not
        used: the released gradient is never clipped again).
    expected_batch_size / sample_rate: exactly one; each row joins each step's batch with
        probability q (= expected_batch_size / N).
    unit_column: a column of the training set; all rows with the same value are one privacy unit
        (user-level DP: e.g. every document of one person). Steps sample units; a unit's gradient is
        summed over all its rows, then clipped. A physical batch then holds
        ``per_device_train_batch_size`` units of R rows each (R: the most rows any unit has).
        None: each row is a unit.
    pack_seq_len: pack the sampled units' documents (each training row one document, of any length;
        every token trained, labels = input_ids) into physical batches of ``per_device_train_batch_size``
        rows of this many tokens, each document attending only to itself, each unit still one sample
        (``longshield_fx.packing``). None: rows are padded to the longest.
    clipping, accountant: as in ``longshield_fx.DPConfig``.
    cp: under torchrun, ranks per context-parallel group (ring attention); the other factor of the
        world size is data parallel ("dp").
    fsdp: mesh dims to shard model and optimizer states over (ZeRO-3 in the graph), e.g.
        ``("dp", "cp")``; None: every rank holds everything.
    fork: continue from a checkpoint older than the newest step in the run ledger of
        ``output_dir`` (or start a new run in an ``output_dir`` whose ledger holds steps), which is
        otherwise refused: ε then covers every step in the ledger, both branches
        (``longshield_fx.run_core.RunLedger``), and privacy.json says the run is a fork.
    insecure_seed: TESTS ONLY (noise and sampling from a public seed: no privacy).
    """

    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    delta: float | None = None
    max_grad_norm: float = 1.0
    expected_batch_size: float | None = None
    sample_rate: float | None = None
    unit_column: str | None = None
    pack_seq_len: int | None = None
    clipping: str = "flat"
    accountant: str = "pld"
    cp: int = 1
    fsdp: tuple[str, ...] | None = None
    fork: bool = False
    insecure_seed: int | None = None

    def __post_init__(self):
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("PrivacyArguments: give exactly one of target_epsilon (σ is calibrated to it) and "
                             "noise_multiplier")
        if (self.expected_batch_size is None) == (self.sample_rate is None):
            raise ValueError("PrivacyArguments: give exactly one of expected_batch_size (rows per step on average) "
                             "and sample_rate")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ValueError(f"PrivacyArguments: target_epsilon must be > 0, got {self.target_epsilon!r}")
        if self.expected_batch_size is not None and not self.expected_batch_size > 0:
            raise ValueError(f"PrivacyArguments: expected_batch_size must be > 0, got {self.expected_batch_size!r}")
        if self.pack_seq_len is not None and not (isinstance(self.pack_seq_len, int) and self.pack_seq_len >= 2):
            raise ValueError(f"PrivacyArguments: pack_seq_len must be an int >= 2, got {self.pack_seq_len!r}")
        if not (isinstance(self.cp, int) and self.cp >= 1):
            raise ValueError(f"PrivacyArguments: cp must be an int >= 1, got {self.cp!r}")
        if self.fsdp is not None:
            self.fsdp = tuple(self.fsdp)
            if not self.fsdp or not set(self.fsdp) <= {"dp", "cp"}:
                raise ValueError(f"PrivacyArguments: fsdp names mesh dims among 'dp' and 'cp', got {self.fsdp!r}")
        if self.delta is not None and not 0 < self.delta < 1:
            raise ValueError(f"PrivacyArguments: delta must be in (0, 1), got {self.delta!r}")


# TrainingArguments DP forbids or this trainer does not carry out, each with its way out.
def _refusals(args: transformers.TrainingArguments) -> list[str]:
    checks = [
        (args.gradient_accumulation_steps != 1,
         "gradient_accumulation_steps: Poisson sampling decides the logical batch; set "
         "PrivacyArguments(expected_batch_size=...) and per_device_train_batch_size (the physical batch), and "
         "leave gradient_accumulation_steps=1"),
        (args.fp16, "fp16: its loss scaling would scale the clipping threshold; use bf16=True"),
        (args.train_sampling_strategy != "random", "train_sampling_strategy: every step's batch is a Poisson sample "
         "(each row joins independently), which no other order may replace; leave it 'random'"),
        (args.auto_find_batch_size, "auto_find_batch_size: the physical batch shape is captured once; set "
         "per_device_train_batch_size yourself and leave it False"),
        (args.n_gpu > 1, "n_gpu > 1 (DataParallel): run one process per GPU with torchrun"),
        (bool(args.deepspeed), "deepspeed: DPTrainer runs its own engine; leave deepspeed unset"),
        (bool(args.fsdp), "fsdp: DPTrainer does not use accelerate's FSDP; leave TrainingArguments.fsdp unset"),
        (args.torch_compile, "torch_compile: the engine compiles the training step itself; set it False"),
        (args.neftune_noise_alpha is not None, "neftune_noise_alpha: NEFTune's embedding noise runs in a forward "
         "hook, which the engine's graph does not run; leave it None"),
        (args.label_smoothing_factor != 0, "label_smoothing_factor: the per-row loss is plain next-token "
         "cross-entropy; set it 0"),
        (args.include_num_input_tokens_seen not in (False, "no"), "include_num_input_tokens_seen: token counts come from the "
         "private rows without noise; leave it off"),
        (args.dataloader_drop_last, "dataloader_drop_last: a Poisson batch has no last batch to drop; set it False"),
        (getattr(args, "use_liger_kernel", False), "use_liger_kernel: it patches the model's forward; set it False"),
        (args.push_to_hub, "push_to_hub: checkpoint folders hold the secret sampling key; save_model() and push "
         "the released model yourself"),
        (getattr(args, "packing", False), "packing: TRL's packing joins several examples into one row, which would "
         "make the row, not the example, the privacy unit; set packing=False"),
        (getattr(args, "padding_free", False), "padding_free: it flattens a batch into one row of several "
         "examples; set padding_free=False"),
        (getattr(args, "loss_type", "nll") != "nll", "loss_type: the per-unit loss is next-token cross-entropy "
         "('nll'); set loss_type='nll'"),
        (getattr(args, "activation_offloading", False), "activation_offloading: the engine's graph keeps or "
         "recomputes activations itself; set it False"),
        (getattr(args, "enable_jit_checkpoint", False), "enable_jit_checkpoint: it saves inside a step, after the "
         "noise and before the optimizer, so the saved sampler and accountant run one step ahead of the model; "
         "use save_strategy"),
        (getattr(args, "parallelism_config", None) is not None, "parallelism_config: accelerate's own parallelism "
         "does not run the engine; use PrivacyArguments(cp=..., fsdp=...)"),
        (getattr(args, "optim", "") in ("lomo", "adalomo"), "optim: LOMO fuses the update into the backward, "
         "which the engine runs before the noise; choose another optimizer"),
        *((True, f"report_to: {why}") for why in _artifact_uploads(args)),
    ]
    return [why for refused, why in checks if refused]


# Logged values that DP covers: the schedule, the step, and the released (noised) gradient's norm.
_COVERED = {"epoch", "step", "learning_rate", "grad_norm", "epsilon", "delta"}


def _artifact_uploads(args) -> list[str]:
    """The reporting integrations asked to upload checkpoint folders or ``output_dir`` (which hold
    the secret ``longshield/`` state), each named with the setting to change."""
    reports = set(args.report_to or ())
    env = {k: os.environ.get(k, "").strip().lower() for k in
           ("WANDB_LOG_MODEL", "HF_MLFLOW_LOG_ARTIFACTS", "HF_DAGSHUB_LOG_ARTIFACTS", "COMET_LOG_ASSETS",
            "HF_DVCLIVE_LOG_MODEL", "CLEARML_LOG_MODEL")}
    on = ("1", "true", "yes", "on", "all")
    uploads = [("wandb", env["WANDB_LOG_MODEL"] == "checkpoint", "WANDB_LOG_MODEL=checkpoint"),
               ("mlflow", env["HF_MLFLOW_LOG_ARTIFACTS"] in on, "HF_MLFLOW_LOG_ARTIFACTS"),
               ("dagshub", env["HF_DAGSHUB_LOG_ARTIFACTS"] in on, "HF_DAGSHUB_LOG_ARTIFACTS"),
               ("comet_ml", env["COMET_LOG_ASSETS"] in on, "COMET_LOG_ASSETS"),
               ("dvclive", env["HF_DVCLIVE_LOG_MODEL"] in on, "HF_DVCLIVE_LOG_MODEL"),
               ("clearml", env["CLEARML_LOG_MODEL"] in on, "CLEARML_LOG_MODEL")]
    return [f"{name} with {setting} uploads checkpoint folders, which hold the secret sampling key; unset "
            f"{setting.split('=')[0]}" for name, asked, setting in uploads if asked and (name in reports or "all" in reports)]


def _inner(optimizer):
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


class DPTrainerMixin:
    """DP-SGD for a ``transformers.Trainer`` subclass: put it first, ``class T(DPTrainerMixin, Trainer)``.
    ``DPTrainer`` and ``DPSFTTrainer`` are the two this module makes; the arguments are the Trainer's,
    plus ``privacy`` (``PrivacyArguments``).

    The model is a causal LM (a transformers model or a peft one); the training set's rows are the
    privacy units (or its rows grouped by ``PrivacyArguments.unit_column``); the collator must give ``input_ids`` and ``labels`` (as ``group_texts`` or
    ``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` do), right-padded (padding positions,
    ``attention_mask`` 0, are not trained on). Rows shorter than the longest are padded to it, so every
    physical batch has one shape. ``gradient_checkpointing=True`` maps to block checkpointing and
    ``bf16=True`` to a bfloat16 compute dtype. The Trainer's checkpoint folders also hold a
    ``longshield/`` folder (model, optimizer, accountant and sampler: SECRET, store it like the data);
    ``train(resume_from_checkpoint=...)`` continues the run's sampling and accounting, with fresh noise.
    Under torchrun, the process groups are destroyed at interpreter exit (``_release_process_groups``).
    """

    def __init__(self, *args, privacy: PrivacyArguments, **kwargs):
        if not isinstance(privacy, PrivacyArguments):
            raise TypeError(f"DPTrainer: privacy must be a longshield_fx.hf.PrivacyArguments, got "
                            f"{type(privacy).__name__}")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        refused = [] if training_args is None else _refusals(training_args)
        if refused:  # before the Trainer starts anything (push_to_hub would create a repository)
            raise ValueError(f"DPTrainer: TrainingArguments.{refused[0]}")
        self._checkpoint = None
        if training_args is not None and training_args.gradient_checkpointing:
            # The engine checkpoints each block in its graph. The Trainer (and TRL, for peft models)
            # would instead switch on the model's own checkpointing and hook the input embeddings.
            self._checkpoint = "block"
            training_args = copy.copy(training_args)
            training_args.activation_checkpointing = training_args.gradient_checkpointing = False
            if "args" in kwargs:
                kwargs["args"] = training_args
            else:
                args = (args[0], training_args, *args[2:])
        super().__init__(*args, **kwargs)
        if self.model_init is not None:
            raise ValueError("DPTrainer: model_init (and hyperparameter search) is not supported: each trial would "
                             "spend privacy; pass model=")
        if self.compute_loss_func is not None:
            raise ValueError("DPTrainer: compute_loss_func is not supported: the per-unit loss is next-token "
                             "cross-entropy summed over the unit's tokens; leave it None")
        if self.args.load_best_model_at_end and privacy.fsdp:
            raise ValueError("DPTrainer: load_best_model_at_end with PrivacyArguments.fsdp: the best checkpoint would "
                             "load whole tensors into sharded parameters; load it after training with "
                             "from_pretrained instead")
        if self.optimizer is not None and privacy.fsdp:
            raise ValueError("DPTrainer: optimizers= with PrivacyArguments.fsdp: the optimizer would hold the "
                             "unsharded parameters that fsdp replaces; pass optimizer_cls_and_kwargs= instead")
        self.privacy = privacy
        self.engine = None
        self._resuming = False
        self._sampler: PoissonBatches | None = None
        self._draws = None

    # --- the run's engine, sampler and data ---------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """One placeholder item per optimizer step of an epoch: the Trainer's loop counts steps with
        it; ``get_batch_samples`` draws the real logical batch."""
        if self.engine is None:
            self._setup()
        elif self.engine.accountant.steps and not self._resuming:
            raise ValueError("DPTrainer: train() ran before on this trainer; another call would spend privacy beyond "
                             "the run's target. Build a new DPTrainer and pass resume_from_checkpoint= to continue")
        return DataLoader(range(len(self._sampler)), batch_size=1)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self._resuming = resume_from_checkpoint not in (None, False)
        if self._resuming:
            self._check_ledger(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

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
            step, fork=self.privacy.fork, where="DPTrainer", what=str(checkpoint), fork_hint=_FORK_HINT)

    def num_examples(self, dataloader) -> int:
        if isinstance(getattr(dataloader, "dataset", None), range):  # the training placeholders
            return len(self._units) if self._units else len(self.train_dataset)
        return super().num_examples(dataloader)

    def _setup(self) -> None:
        if self.train_dataset is None:
            raise ValueError("DPTrainer: train() needs a train_dataset")
        dataset, collate = self.train_dataset, self.data_collator
        try:
            import datasets
        except ImportError:
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        self._rows, self._collate = dataset, collate
        p = self.privacy
        self._units = _units(self.train_dataset, p.unit_column) if p.unit_column else None
        N = len(self._units) if self._units else len(dataset)
        q = p.sample_rate if p.sample_rate is not None else p.expected_batch_size / N
        if not 0 < q <= 1:
            raise ValueError(f"DPTrainer: expected_batch_size {p.expected_batch_size:g} over {N} training units is a "
                             f"sample rate of {q:g}, not in (0, 1]; ask for fewer units per step")
        if self._units and p.cp > 1 and not p.pack_seq_len:
            raise ValueError("DPTrainer: PrivacyArguments.unit_column with cp > 1 runs with packing only "
                             "(pack_seq_len=...); or use cp=1 (dp and fsdp work)")
        self._delta = p.delta if p.delta is not None else default_delta(N)
        self._pad_id = _pad_id(self.processing_class, self.model)
        rows = self.args.per_device_train_batch_size
        if p.pack_seq_len:
            units = self._units or [[i] for i in range(N)]
            self._sampler = PackedPoissonBatches([[self._document(i) for i in unit] for unit in units], q,
                                                 seq_len=p.pack_seq_len, rows=rows, unit_slots=unit_slots_for(rows),
                                                 pad_id=self._pad_id, insecure_seed=p.insecure_seed)
            # Statistics of the private data (not covered by DP): kept here, said once by the main process.
            self.truncated_units = self._sampler.truncated_units
            self.dropped_tokens = self._sampler.dropped_tokens
            if self.truncated_units and self.is_world_process_zero():
                transformers.utils.logging.get_logger(__name__).warning(
                    f"DPTrainer: {self.truncated_units} units truncated ({self.dropped_tokens} tokens dropped): packing "
                    f"keeps at most per_device_train_batch_size={rows} rows of pack_seq_len={p.pack_seq_len} tokens "
                    "of each unit (one piece of at most pack_seq_len tokens of one document per row, longest first); "
                    "the dropped tokens are never trained on. These counts come from the private training data and "
                    "are NOT covered by DP. To train on every token, raise per_device_train_batch_size (a unit of "
                    "many documents needs a row per document) or pack_seq_len (a long document needs "
                    "len / pack_seq_len rows)")
        else:
            self._seq_len = max(len(row["input_ids"]) for row in dataset)
            self._sampler = PoissonBatches(torch.arange(N), q, rows, insecure_seed=p.insecure_seed)
            self.truncated_units = self.dropped_tokens = 0  # rows are padded to the longest, never cut
        steps = self.args.max_steps if self.args.max_steps > 0 else \
            math.ceil(self.args.num_train_epochs * len(self._sampler))
        sigma = p.noise_multiplier if p.noise_multiplier is not None else \
            calibrated_sigma(p.target_epsilon, self._delta, q, steps, p.accountant)
        self._ledger = RunLedger(self.args.output_dir)
        if not self._resuming:  # a new run: a ledger already here holds another run's released steps
            fresh_start = self._ledger.admit(None, fork=p.fork, fork_hint=_FORK_HINT, where="DPTrainer")
        config = lf.DPConfig(p.max_grad_norm, sigma, clipping=p.clipping, accountant=p.accountant,
                             insecure_seed=p.insecure_seed,
                             compute_dtype=torch.bfloat16 if self.args.bf16 else torch.float32)
        _drop_input_require_grads_hooks(self.model)
        mesh, self._dp, self._dp_rank = self._mesh()
        self._dp_mesh = mesh["dp"] if self._dp > 1 else None  # not its group: see _release_process_groups
        loss = PackedCausalLMLoss(self.model) if p.pack_seq_len else CausalLMLoss(self.model)
        self.engine = lf.compile(loss, mesh, config=config, checkpoint=self._checkpoint, fsdp=p.fsdp,
                                 packed_units=self._sampler.unit_slots if p.pack_seq_len else 0)
        if not self._resuming:
            self.engine.accountant.released_elsewhere = fresh_start

    def _document(self, i: int) -> list[int]:
        """Row ``i``'s token ids, one document for packing (which trains every token: labels = ids)."""
        row = self._rows[i]
        ids = [int(t) for t in row["input_ids"]]
        if "labels" in row and [int(t) for t in row["labels"]] != ids:
            raise ValueError(f"DPTrainer: packing (PrivacyArguments.pack_seq_len) trains every token of a document, "
                             f"but row {i}'s labels differ from its input_ids; leave pack_seq_len unset to keep "
                             "the labels")
        return ids

    def _mesh(self):
        """(mesh or None, dp, this rank's dp index): under torchrun, world = dp x cp. The mesh's
        groups run gloo on one worker thread (``serial_gloo``: torch's two-thread gloo races)."""
        world, cp = self.args.world_size, self.privacy.cp
        if world % cp:
            raise ValueError(f"DPTrainer: PrivacyArguments.cp={cp} does not divide the {world} processes; launch "
                             f"a multiple of {cp} with torchrun --nproc-per-node")
        if world == 1:
            if self.privacy.fsdp:
                raise ValueError("DPTrainer: PrivacyArguments.fsdp shards over several processes; launch with "
                                 "torchrun, or leave fsdp=None")
            return None, 1, 0
        from torch.distributed.device_mesh import init_device_mesh

        from ._torch import serial_gloo

        device, dp = self.args.device.type, world // cp
        names = ("dp", "cp") if dp > 1 else ("cp",)
        missing = set(self.privacy.fsdp or ()) - set(names)
        if missing:
            raise ValueError(f"DPTrainer: PrivacyArguments.fsdp names {sorted(missing)}, but the mesh of {world} "
                             f"processes at cp={cp} has only {names}")
        override = {} if device == "cuda" else {name: serial_gloo() for name in names}
        mesh = init_device_mesh(device, (dp, cp) if dp > 1 else (cp,), mesh_dim_names=names,
                                backend_override=override)
        atexit.unregister(_release_process_groups)  # registered once per process, whatever the trainers
        atexit.register(_release_process_groups)
        return mesh, dp, (mesh["dp"].get_local_rank() if dp > 1 else 0)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """The next Poisson logical batch, one per placeholder the Trainer's loop takes."""
        taken = [item for _, item in zip(range(num_batches), epoch_iterator)]
        if self._draws is None:  # after any checkpoint load: the sampler's stream is where it was saved
            self._draws = self._logical_batches()
        return [next(self._draws) for _ in taken], None

    def _logical_batches(self):
        while True:
            yield from self._sampler

    def _physical(self, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of the sampled rows, (B, T); or with a unit column, of the sampled
        units, (B, R, T), each unit's rows first and then rows of padding (labels -100)."""
        if self._units is None:
            return self._collated(samples.tolist())
        members = [self._units[u] for u in samples.tolist()]
        ids, labels = self._collated([i for rows in members for i in rows])
        R = max(len(rows) for rows in self._units)
        out_ids = ids.new_full((len(members), R, ids.shape[1]), self._pad_id)
        out_labels = labels.new_full((len(members), R, ids.shape[1]), -100)
        k = 0
        for b, rows in enumerate(members):
            out_ids[b, :len(rows)], out_labels[b, :len(rows)] = ids[k:k + len(rows)], labels[k:k + len(rows)]
            k += len(rows)
        return out_ids, out_labels

    def _collated(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of dataset ``rows``, collated and right-padded to the longest row of
        the training set, ``self._seq_len``: every physical batch has that one length. A collator
        that pads further (``pad_to_multiple_of``) adds columns of padding past it, which are cut."""
        batch = self._collate([self._rows[i] for i in rows])
        if "labels" not in batch:
            raise ValueError("DPTrainer: the collated batch has no 'labels'; copy input_ids to labels (as "
                             "group_texts does) or use DataCollatorForLanguageModeling(tokenizer, mlm=False)")
        ids, labels = torch.as_tensor(batch["input_ids"]), torch.as_tensor(batch["labels"])
        mask = batch.get("attention_mask")
        if mask is not None:
            mask = torch.as_tensor(mask)
            if bool((mask[:, 1:] > mask[:, :-1]).any()):
                raise ValueError("DPTrainer: a row is left-padded (attention_mask 0 before 1); the loss reads rows "
                                 "as causal sequences from their first position: set tokenizer.padding_side = "
                                 "'right'")
            labels = labels.masked_fill(mask == 0, -100)
        T = self._seq_len
        if ids.shape[1] > T:
            # Past the longest training row a collator can only have padded (pad_to_multiple_of): the
            # columns cut predict nothing (labels -100) and attend to nothing that is kept.
            real = labels[:, T:] != -100
            if mask is not None:
                real |= mask[:, T:] != 0
            if bool(real.any()):
                raise ValueError(f"DPTrainer: the collator returned rows of {ids.shape[1]} tokens with a real token "
                                 f"(attention_mask 1 or a label other than -100) past token {T}, the length of the "
                                 "longest training row; every physical batch is cut to that length, so the collator "
                                 "may add padding only (right-padded, labels -100): do not let it add or lengthen "
                                 "rows")
            ids, labels = ids[:, :T].contiguous(), labels[:, :T].contiguous()  # the capture guards strides
        pad = T - ids.shape[1]
        if pad > 0:
            ids = torch.nn.functional.pad(ids, (0, pad), value=self._pad_id)
            labels = torch.nn.functional.pad(labels, (0, pad), value=-100)
        return ids.to(self.args.device), labels.to(self.args.device)

    # --- one optimizer step -------------------------------------------------------------------
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        # The engine's module, not self.model: the Trainer then leaves it unwrapped (no DDP, whose
        # hooks would all-reduce and hold the gradients the engine writes).
        return self.engine.model if training and self.engine is not None else model

    def training_step(self, model, inputs: LogicalBatch, num_items_in_batch=None) -> torch.Tensor:
        """Accumulate every physical batch of the logical batch, then add the noise once and write
        ``.grad``. Returns the mean token loss of the sampled rows (NOT covered by DP)."""
        model.train()  # evaluation leaves it in eval mode; the engine's graph is the training one
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()  # schedule-free optimizers keep train and eval weights
        loss, tokens = 0.0, 0
        for tensors, mask in inputs.share(self._dp_rank, self._dp):
            if self.privacy.pack_seq_len:  # (ids, labels, positions, unit slots); the slots say who is in it
                batch = [t.to(self.args.device) for t in tensors]
                loss += float(self.engine.accumulate(*batch))
                tokens += int((batch[3] < self._sampler.unit_slots).sum())
                continue
            ids, labels = self._physical(tensors[0])
            loss += float(self.engine.accumulate(ids, labels, mask=mask))
            tokens += int(((labels[..., 1:] != -100).flatten(1).sum(1).cpu() * mask).sum())
        self.engine.finalize(inputs)
        if self._dp > 1:  # every dp group ran its share; the logged loss is the logical batch's
            both = torch.tensor([loss, tokens], dtype=torch.float64, device=self.args.device)  # NCCL: on GPU
            torch.distributed.all_reduce(both, group=self._dp_mesh.get_group())
            loss, tokens = float(both[0]), int(both[1])
        return torch.tensor(loss / max(tokens, 1), device=self.args.device)

    def _clip_grad_norm(self, model):
        # The released gradient is already clipped per row and noised; its norm is logged unclipped.
        return None

    def floating_point_ops(self, inputs) -> int:
        return 0

    # --- logs ---------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds ε and δ; renames in place (so the caller's dict, e.g. ``train()``'s metrics, says it
        too) every training value that comes from the private rows without noise to ``<key>_not_dp``:
        losses, timings, sample and token counts. Evaluation values (``eval_*``) are on held-out data."""
        if self.engine is not None:
            self._record("log")  # grad_norm is the released gradient's, eval_* the model's
            for key in [k for k in logs if k not in _COVERED and not k.startswith(("eval_", "test_"))]:
                logs[f"{key}_not_dp"] = logs.pop(key)
            logs["epsilon"] = self.engine.epsilon(self._delta)
            logs["delta"] = self._delta
        super().log(logs, start_time)

    # --- saving and resuming ------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        with self._whole_parameters():
            super().save_model(output_dir, _internal_call)

    def evaluate(self, *args, **kwargs):
        self._record("evaluation")
        with self._whole_parameters():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        self._record("prediction")
        with self._whole_parameters():
            return super().predict(*args, **kwargs)

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

    def privacy_record(self, final: bool = True) -> dict:
        """privacy.json: the guarantee of the model as trained so far (``run_core.privacy_record``);
        ``final=False``: a checkpoint's copy, which says it is not the final release."""
        p = self.privacy
        unit = (f"all rows with one value of {p.unit_column!r} (add/remove one unit)" if p.unit_column
                else "one training row (add/remove one row)")
        return privacy_record(
            self.engine, delta=self._delta, delta_given=p.delta is not None, unit=unit,
            sample_rate=self._sampler.sample_rate, sample_rate_chosen=p.sample_rate is not None, model=self.model,
            insecure_seed=p.insecure_seed, final=final,
            not_covered="training losses (loss_not_dp) come from the data without noise; evaluation data is never "
                        "trained on and is not protected by ε",
            privacy_arguments=asdict(p))

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

    def hyperparameter_search(self, *args, **kwargs):
        raise ValueError("DPTrainer: hyperparameter search trains many models on the private data, and each trial "
                         "spends privacy that this trainer does not account; tune on public data")


def _release_process_groups() -> None:
    """At interpreter exit, while it is whole: every process group destroyed and its threads joined.

    A Trainer script ends without destroying its groups, and the mesh's (DTensor parameters and
    DTensor's caches hold it) would run their gloo threads into interpreter finalization, where one
    can abort a rank that finished everything ("terminate called without an active exception",
    ``_torch.destroy_process_groups``). The script's evaluation and saving after ``train()`` still
    need the groups, so this runs at exit, not when training ends; a group is reached through the
    meshes that hold it, never kept in a trainer's attribute. After an uncaught exception the
    peers may be gone or mid-collective: the groups are then only destroyed, nothing is waited on."""
    from ._torch import destroy_process_groups

    failed = hasattr(sys, "last_exc") or hasattr(sys, "last_value")  # set by the uncaught exception's report
    destroy_process_groups(peers_finished=not failed)


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


def _drop_input_require_grads_hooks(model) -> None:
    """Remove the forward hooks transformers' ``enable_input_require_grads`` and peft put on the
    input embeddings (TRL adds one for every peft model): they call ``requires_grad_`` on the
    embeddings' output so that eager reentrant checkpointing sees a grad-requiring input. The
    engine never runs the eager backward, and in a captured graph that side effect cuts the
    adapters' gradients. Several calls leave several hooks, and transformers keeps the handle of
    the last only, so they are found by name."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    hooks = getattr(embeddings, "_forward_hooks", {})  # nn.Module's own registry: the handles are lost
    for key, hook in list(hooks.items()):
        if getattr(hook, "__name__", "") in ("make_inputs_require_grads", "make_inputs_require_grad"):
            del hooks[key]


def _units(dataset, column: str) -> list[list[int]]:
    """The row indices of each unit (in order of first appearance), from ``column``. Values name
    units through ``run_core.canonical_unit_id``, as the CLI's unit keys do: 'alice', ' ALICE' and
    'ａｌｉｃｅ' are one unit, 5 and "5" one, "5" and "05" two (folding only merges, which is
    conservative; a person split over k spellings would cost about k·ε)."""
    import numbers

    from .run_core import canonical_unit_id

    try:
        keys = dataset[column] if hasattr(dataset, "column_names") else [row[column] for row in dataset]
    except (KeyError, TypeError):
        raise ValueError(f"DPTrainer: PrivacyArguments.unit_column={column!r} is not a column of the training "
                         "set") from None
    groups: dict = {}
    for i, key in enumerate(keys):
        if isinstance(key, numbers.Integral) and not isinstance(key, bool):
            key = int(key)  # numpy's integers too
        elif not isinstance(key, str):
            raise ValueError(f"DPTrainer: row {i} of the training set has {column}={key!r} "
                             f"({type(key).__name__}); the values of PrivacyArguments.unit_column={column!r} "
                             "name privacy units and must be strings or integers: give the row its unit's id "
                             "or drop it")
        name = canonical_unit_id(key)
        if not name:
            raise ValueError(f"DPTrainer: row {i} of the training set has an empty {column}={key!r} (blank once "
                             f"whitespace and invisible characters are removed); give the row its unit's id")
        groups.setdefault(name, []).append(i)
    return list(groups.values())


def _pad_id(tokenizer, model) -> int:
    for source in (tokenizer, getattr(model, "config", None)):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None)
            if isinstance(value, int):
                return value
    return 0
