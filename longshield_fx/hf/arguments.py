"""The DP settings of a ``DPTrainer`` run, and the ``TrainingArguments`` it refuses (each with
its way out)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import transformers


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
        rows of this many tokens (a logical batch's last ones of a half, a quarter, ... of those rows:
        ``longshield_fx.packing.row_counts``), each document attending only to itself, each unit
        still one sample (``longshield_fx.packing``). None: rows are padded to the longest.
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
        if self.sample_rate is not None and not 0 < self.sample_rate <= 1:
            raise ValueError(f"PrivacyArguments: sample_rate must be in (0, 1], got {self.sample_rate!r}")
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
def refusals(args: transformers.TrainingArguments) -> list[str]:
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


def _artifact_uploads(args) -> list[str]:
    """The reporting integrations asked to upload checkpoint folders or ``output_dir`` (which hold
    the secret ``longshield/`` state), each named with the setting to change."""
    reports = set(args.report_to or ())
    env = {k: os.environ.get(k, "").strip().lower() for k in
           ("WANDB_LOG_MODEL", "HF_MLFLOW_LOG_ARTIFACTS", "HF_DAGSHUB_LOG_ARTIFACTS", "COMET_LOG_ASSETS",
            "HF_DVCLIVE_LOG_MODEL", "CLEARML_LOG_MODEL")}
    on, off = ("1", "true", "yes", "on", "all"), ("0", "false", "no", "off")
    secret = "uploads checkpoint folders, which hold the secret sampling key"
    uploads = [("wandb", env["WANDB_LOG_MODEL"] == "checkpoint", f"{secret}; unset WANDB_LOG_MODEL"),
               ("mlflow", env["HF_MLFLOW_LOG_ARTIFACTS"] in on, f"{secret}; unset HF_MLFLOW_LOG_ARTIFACTS"),
               ("dagshub", env["HF_DAGSHUB_LOG_ARTIFACTS"] in on, f"{secret}; unset HF_DAGSHUB_LOG_ARTIFACTS"),
               ("comet_ml", env["COMET_LOG_ASSETS"] in on, f"{secret}; unset COMET_LOG_ASSETS"),
               ("dvclive", env["HF_DVCLIVE_LOG_MODEL"] in on, f"{secret}; unset HF_DVCLIVE_LOG_MODEL"),
               # ClearML's callback uploads them unless CLEARML_LOG_MODEL says not to (its default is TRUE)
               ("clearml", env["CLEARML_LOG_MODEL"] not in off, f"{secret} unless told not to; set CLEARML_LOG_MODEL=false"),
               ("flyte", True, f"{secret} (its callback syncs each one, which report_to cannot turn off); remove "
                               "flyte from report_to")]
    return [f"{name} {why}" for name, asked, why in uploads if asked and (name in reports or "all" in reports)]
