"""``DPTrainerMixin``: DP-SGD for a ``transformers.Trainer`` subclass (see ``longshield_fx.hf``)."""
from __future__ import annotations

import atexit
import copy
import math
import sys
from dataclasses import asdict

import torch
import transformers
from torch.utils.data import DataLoader

import longshield_fx as lf

from ..data import LogicalBatch, PoissonBatches
from ..losses import CausalLMLoss, PackedCausalLMLoss, packed_predicted_tokens
from ..packing import PackedPoissonBatches, capture_every_row_count, unit_slots_for
from ..run_core import RunLedger, calibrated_sigma, default_delta, privacy_record
from .arguments import PrivacyArguments, refusals
from .batches import UnitBatchesMixin, pad_token_id, unit_rows
from .checkpoints import FORK_HINT, LedgerCheckpointsMixin

# Logged values that DP covers: the schedule, the step, and the released (noised) gradient's norm.
_COVERED = {"epoch", "step", "learning_rate", "grad_norm", "epsilon", "delta"}


class DPTrainerMixin(LedgerCheckpointsMixin, UnitBatchesMixin):
    """DP-SGD for a ``transformers.Trainer`` subclass: put it first, ``class T(DPTrainerMixin, Trainer)``.
    ``DPTrainer`` and ``DPSFTTrainer`` are the two ``longshield_fx.hf`` makes; the arguments are the Trainer's,
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
        refused = [] if training_args is None else refusals(training_args)
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
        if self.args.eval_strategy != "no":
            self._refuse_training_rows(self.eval_dataset, "evaluation during training")  # before any step
        self._resuming = resume_from_checkpoint not in (None, False)
        if self._resuming:
            self._check_ledger(resume_from_checkpoint)
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        nonfinite = torch.tensor(self.engine.nonfinite_samples, dtype=torch.float64, device=self.args.device)
        if self._dp > 1:  # each dp group counts its own units; the cp ranks of a group count the same ones
            torch.distributed.all_reduce(nonfinite, group=self._dp_mesh.get_group())
        if self.is_world_process_zero():  # the logs' epsilon and delta, with what they protect and how
            record = self.privacy_record(final=False)
            print(f"DPTrainer: ε = {record['epsilon']:.3f}, δ = {record['delta']:.3g}, {record['accountant']} "
                  f"accountant, after {record['steps']} steps; the unit ε protects: {record['privacy_unit']}. "
                  f"Non-finite per-unit gradients, contributing nothing (NOT covered by DP): "
                  f"{int(nonfinite)}")
        return output

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
        self._units = unit_rows(self.train_dataset, p.unit_column) if p.unit_column else None
        N = len(self._units) if self._units else len(dataset)
        q = p.sample_rate if p.sample_rate is not None else p.expected_batch_size / N
        if not 0 < q <= 1:
            raise ValueError(f"DPTrainer: expected_batch_size {p.expected_batch_size:g} over {N} training units is a "
                             f"sample rate of {q:g}, not in (0, 1]; ask for fewer units per step")
        if self._units and p.cp > 1 and not p.pack_seq_len:
            raise ValueError("DPTrainer: PrivacyArguments.unit_column with cp > 1 runs with packing only "
                             "(pack_seq_len=...); or use cp=1 (dp and fsdp work)")
        self._delta = p.delta if p.delta is not None else default_delta(N)
        self._pad_id = pad_token_id(self.processing_class, self.model)
        rows = self.args.per_device_train_batch_size
        if p.pack_seq_len:
            if rows < 2:
                raise ValueError(f"DPTrainer: pack_seq_len packs each physical batch into per_device_train_batch_size "
                                 f"rows of pack_seq_len tokens, at least 2 (a packed batch of one row is not run), "
                                 f"got {rows}; raise it to 2 or more")
            units = self._units or [[i] for i in range(N)]
            slots = unit_slots_for(rows, p.pack_seq_len, q * N)
            self._sampler = PackedPoissonBatches([[self._document(i) for i in unit] for unit in units], q,
                                                 seq_len=p.pack_seq_len, rows=rows, unit_slots=slots,
                                                 pad_id=self._pad_id, insecure_seed=p.insecure_seed)
            # Statistics of the private data (not covered by DP): kept here, said once by the main process.
            self.truncated_units = self._sampler.truncated_units
            self.dropped_tokens = self._sampler.dropped_tokens
            if self.truncated_units and self.is_world_process_zero():
                transformers.utils.logging.get_logger(__package__).warning(
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
            fresh_start = self._ledger.admit(None, fork=p.fork, fork_hint=FORK_HINT, where="DPTrainer")
        config = lf.DPConfig(p.max_grad_norm, sigma, clipping=p.clipping, accountant=p.accountant,
                             insecure_seed=p.insecure_seed,
                             compute_dtype=torch.bfloat16 if self.args.bf16 else torch.float32)
        _drop_input_require_grads_hooks(self.model)
        mesh, self._dp, self._dp_rank = self._mesh()
        self._dp_mesh = mesh["dp"] if self._dp > 1 else None  # not its group: see _release_process_groups
        loss = PackedCausalLMLoss(self.model) if p.pack_seq_len else CausalLMLoss(self.model)
        self.engine = lf.compile(loss, mesh, config=config, checkpoint=self._checkpoint, fsdp=p.fsdp,
                                 packed_units=self._sampler.unit_slots if p.pack_seq_len else 0)
        if p.pack_seq_len:  # as the CLI: the isolation probe runs now, on every rank, whatever is drawn
            self.model.train()  # training_step's mode (from_pretrained gives eval): the graph it will run
            capture_every_row_count(self.engine, self.model, rows, p.pack_seq_len, self._sampler.unit_slots,
                                    self.args.device)
        if not self._resuming:
            self.engine.accountant.released_elsewhere = fresh_start

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

        from .._torch import serial_gloo

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
        if self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps:
            # transformers' loop, resumed from a run's last step mid-epoch, takes one more step
            # before its callback stops it: that step would spend privacy beyond the run's budget.
            raise ValueError(f"DPTrainer: the run has taken its {self.state.max_steps} steps (max_steps, or "
                             "num_train_epochs); another would spend privacy beyond the budget σ was set for, and "
                             "nothing was trained. Its final model is in output_dir; to train on, start a new run")
        taken = [item for _, item in zip(range(num_batches), epoch_iterator)]
        if self._draws is None:  # after any checkpoint load: the sampler's stream is where it was saved
            self._draws = self._logical_batches()
        return [next(self._draws) for _ in taken], None

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
            if self.privacy.pack_seq_len:  # (ids, labels, positions, unit slots)
                batch = [t.to(self.args.device) for t in tensors]
                loss += float(self.engine.accumulate(*batch))
                tokens += packed_predicted_tokens(*batch[1:])
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

    def evaluate(self, eval_dataset=None, *args, **kwargs):
        self._refuse_training_rows(self.eval_dataset if eval_dataset is None else eval_dataset, "evaluate")
        self._record("evaluation")
        with self._whole_parameters():
            return super().evaluate(eval_dataset, *args, **kwargs)

    def predict(self, test_dataset, *args, **kwargs):
        self._refuse_training_rows(test_dataset, "predict")
        self._record("prediction")
        with self._whole_parameters():
            return super().predict(test_dataset, *args, **kwargs)

    def _refuse_training_rows(self, data, what: str) -> None:
        """Evaluation metrics are released without noise beside ε, as held-out data's: refused
        when the data is the training set itself (the same object, or a ``datasets.Dataset`` with
        its fingerprint), whose metrics would be noise-free statistics of the private rows."""
        train = self.train_dataset
        for name, part in (data.items() if isinstance(data, dict) else [(None, data)]):
            fingerprint = getattr(part, "_fingerprint", None)
            if part is not None and (part is train or (
                    fingerprint is not None and fingerprint == getattr(train, "_fingerprint", None))):
                raise ValueError(f"DPTrainer: {what} on the training data{f' ({name!r})' if name else ''}: its "
                                 "metrics would be statistics of the private rows without noise, logged beside ε as "
                                 "if held out; evaluate on data the model is not trained on")

    def privacy_record(self, final: bool = True) -> dict:
        """privacy.json: the guarantee of the model as trained so far (``run_core.privacy_record``);
        ``final=False``: a checkpoint's copy, which says it is not the final release."""
        p = self.privacy
        unit = (f"all rows with one value of {p.unit_column!r} (add/remove one unit)" if p.unit_column
                else "one training row (add/remove one row)")
        arguments = asdict(p)
        if p.sample_rate is None:  # q = E / N is written: E beside it would give N, which is private
            del arguments["expected_batch_size"]
        return privacy_record(
            self.engine, delta=self._delta, delta_given=p.delta is not None, unit=unit,
            sample_rate=self._sampler.sample_rate, sample_rate_chosen=p.sample_rate is not None, model=self.model,
            insecure_seed=p.insecure_seed, final=final,
            not_covered="training losses (loss_not_dp) come from the data without noise; evaluation data is not "
                        "protected by ε (evaluating on the training data itself is refused)",
            privacy_arguments=arguments)

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
    from .._torch import destroy_process_groups

    failed = hasattr(sys, "last_exc") or hasattr(sys, "last_value")  # set by the uncaught exception's report
    destroy_process_groups(peers_finished=not failed)


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
