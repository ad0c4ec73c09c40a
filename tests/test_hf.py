"""``longshield_fx.hf.DPTrainer``: a causal-LM fine-tuning script written as transformers'
documentation writes it (``datasets`` text files, tokenize, ``group_texts``, the LM collator,
``TrainingArguments``, ``Trainer(...).train()``, evaluate, save) runs both ways; the DP version
differs in at most five lines, and its released model equals our engine's own loop on the same
logical batches, bitwise (public seeds, tests only)."""
from __future__ import annotations

import copy
import difflib
import json
import re

import datasets  # noqa: F401  (in the test extra: the script loads its text files with it)
import pytest
import torch
import transformers

import finetune_fixtures as ff
import hf_trainer_script as hts
import longshield_fx as lf
from hf_trainer_script import NOISELESS, PRIVATE, SCRIPT, SEED
from longshield_fx.hf import DPTrainer, PrivacyArguments

def run(script: str, **names) -> dict:
    scope = dict(names, __name__="finetune_clm")
    exec(compile(script, "finetune_clm.py", "exec"), scope)
    return scope


# Session-scoped, as noiseless_run: the test that reads the Trainer's torchrun launches runs at the
# session's end (conftest._stage), after this module's other tests, and would otherwise rebuild both.
@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_trainer")
    return (root, *hts.folders(root))


@pytest.fixture(scope="module")
def dp_run(folders):
    root, model_dir, data = folders
    return run(PRIVATE, MODEL_DIR=model_dir, DATA=str(data), OUT=str(root / "dp"), SEED=SEED)


def test_the_private_script_differs_in_at_most_five_lines_and_the_plain_one_runs(folders):
    changed = [line for line in difflib.unified_diff(SCRIPT.splitlines(), PRIVATE.splitlines(), lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert 0 < len(changed) <= 5, changed
    root, model_dir, data = folders
    plain = run(SCRIPT, MODEL_DIR=model_dir, DATA=str(data), OUT=str(root / "plain"))
    assert plain["trainer"].state.global_step == 6 and "eval_loss" in plain["eval_results"]


def _engine_loop(model_dir: str, rows: torch.Tensor, args: transformers.TrainingArguments, steps: int):
    """Our engine's own loop over the same rows: the Trainer's optimizer and LR schedule (built by
    transformers from the same arguments), the same public seeds."""
    lm = transformers.AutoModelForCausalLM.from_pretrained(model_dir).train()
    engine = lf.compile(lf.CausalLMLoss(lm), config=lf.DPConfig(1.0, 1.0, insecure_seed=SEED))
    plain = copy.copy(args)
    plain.eval_strategy = "no"  # a Trainer here only builds the optimizer, as DPTrainer's does
    optimizer = transformers.Trainer(model=lm, args=plain).create_optimizer()
    scheduler = transformers.get_scheduler(args.lr_scheduler_type, optimizer=optimizer,
                                           num_warmup_steps=args.get_warmup_steps(steps), num_training_steps=steps)
    sampler = lf.data.PoissonBatches(rows, 8 / len(rows), args.per_device_train_batch_size, insecure_seed=SEED)
    draws = iter(sampler)
    for _ in range(steps):
        batch = next(draws)
        for (ids,), mask in batch.physical:
            engine.accumulate(ids, ids, mask=mask)
        engine.finalize(batch)
        optimizer.step()
        scheduler.step()
        lm.zero_grad()
    return lm, engine


def test_released_model_equals_the_engine_loop_and_logs_the_accountants_epsilon(dp_run, folders):
    trainer = dp_run["trainer"]
    rows = torch.tensor(trainer.train_dataset["input_ids"])
    lm, engine = _engine_loop(folders[1], rows, trainer.args, 6)
    for (name, ours), theirs in zip(trainer.model.named_parameters(), lm.parameters(), strict=True):
        assert torch.equal(ours, theirs), name
    delta = trainer.privacy_record()["delta"]
    logged = [e for e in trainer.state.log_history if "loss_not_dp" in e]
    assert [e["step"] for e in logged] == [2, 4, 6] and "loss" not in logged[-1]
    final_metrics = next(e for e in trainer.state.log_history if "train_loss_not_dp" in e)  # train()'s own
    assert {"train_loss_not_dp", "train_runtime_not_dp", "train_samples_per_second_not_dp", "epsilon"} <= \
        set(final_metrics) and not any(k.startswith("train_") and not k.endswith("_not_dp") for k in final_metrics)
    # The trainer's accountant composed its steps as they were logged (2 + 1 + 1 + 2), the loop's
    # all 6 at once: PLD's discretised compositions agree to ~1e-10, each an upper bound.
    assert logged[-1]["epsilon"] == trainer.engine.epsilon(delta) == pytest.approx(engine.epsilon(delta), rel=1e-9)
    assert trainer.engine.accountant.history == engine.accountant.history and engine.epsilon(delta) > 0
    evaluated = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in evaluated] == [3, 6, 6] and evaluated[-1]["epsilon"] == trainer.engine.epsilon(delta)
    final = folders[0] / "dp" / "final"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(final)
    for (name, ours), theirs in zip(trainer.model.named_parameters(), reloaded.parameters(), strict=True):
        assert torch.equal(ours, theirs), name
    record = json.loads((final / "privacy.json").read_text())
    assert record["epsilon"] == trainer.engine.epsilon(delta) and record["steps"] == 6 and record["privacy_void"]




@pytest.fixture(scope="session")
def noiseless_run(folders):
    """The private script at σ = 0 (so that runs over other layouts can be compared), no evaluation."""
    root, model_dir, data = folders
    script = NOISELESS.replace('eval_strategy="steps"', 'eval_strategy="no"')
    return run(script, MODEL_DIR=model_dir, DATA=data, OUT=str(root / "noiseless"), SEED=SEED)["trainer"]


def test_resuming_a_checkpoint_folder_continues_the_run(folders, noiseless_run, tmp_path):
    """Noise 0: the run resumed from checkpoint-3 ends where the uninterrupted one does, with the
    same accounted steps; the checkpoint's secret engine state is in its longshield/ folder."""
    root, model_dir, data = folders
    private = NOISELESS.replace('eval_strategy="steps"', 'eval_strategy="no"')
    whole = noiseless_run
    checkpoint = root / "noiseless" / "checkpoint-3"
    assert (checkpoint / "longshield").is_dir() and (checkpoint / "privacy.json").is_file()
    resumed_script = private.replace("trainer.train()", f"trainer.train(resume_from_checkpoint={str(checkpoint)!r})") \
        .replace("insecure_seed=SEED)", "insecure_seed=SEED, fork=True)")  # the run went on to step 6
    resumed = run(resumed_script, MODEL_DIR=model_dir, DATA=data, OUT=str(tmp_path / "resumed"), SEED=SEED)["trainer"]
    assert resumed.state.global_step == 6 and resumed.engine.accountant.steps == whole.engine.accountant.steps == 6
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def _resuming(checkpoint) -> str:
    """The private script, evaluating only at its end, resumed from ``checkpoint``."""
    return PRIVATE.replace('eval_strategy="steps"', 'eval_strategy="no"').replace(
        "trainer.train()", f"trainer.train(resume_from_checkpoint={str(checkpoint)!r})")


def test_resuming_an_older_checkpoint_is_refused_unless_forked_and_a_fork_draws_fresh_noise(folders, dp_run,
                                                                                             tmp_path):
    """σ = 1: the DP run went on to step 6, so its checkpoint-3 is refused (the run ledger in its
    output_dir holds steps 1-6) in one line naming step 6 and the way out. Forked, the resumed run
    draws the same batches and accounts the same branch, with other noise: its model differs from
    the uninterrupted run's, and its ε covers both branches, steps 4-6 as the same subsampled batches
    released twice (σ/√2), equal to dp-accounting's own PLD accountant over that history."""
    import dp_accounting

    from longshield_fx.run_core import RollbackRefused

    root, model_dir, data = folders
    script = _resuming(root / "dp" / "checkpoint-3")
    with pytest.raises(RollbackRefused, match=r"records step 6, released, and .*checkpoint-3 is at step 3.*PrivacyArguments\(fork=True\)"):
        run(script, MODEL_DIR=model_dir, DATA=data, OUT=str(tmp_path / "refused"), SEED=SEED)
    assert not (tmp_path / "refused" / "checkpoint-6").exists()
    forked = script.replace("insecure_seed=SEED)", "insecure_seed=SEED, fork=True)")
    resumed = run(forked, MODEL_DIR=model_dir, DATA=data, OUT=str(tmp_path / "fork"), SEED=SEED)["trainer"]
    whole = dp_run["trainer"]
    assert resumed.engine.accountant.history == whole.engine.accountant.history
    assert resumed._sampler.state_dict()["step"] == whole._sampler.state_dict()["step"] == 6
    assert not torch.equal(resumed.model.lm_head.weight, whole.model.lm_head.weight)
    q, delta = resumed._sampler.sample_rate, resumed.privacy_record()["delta"]
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)), 3)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(2 ** -0.5)), 3)
    assert resumed.engine.epsilon(delta) == pytest.approx(accountant.get_epsilon(delta), rel=1e-6)
    record = json.loads((tmp_path / "fork" / "final" / "privacy.json").read_text())
    assert record["fork"]["steps_released_by_other_branches"] == 3 and record["release"] == "final"
    assert record["epsilon"] == resumed.engine.epsilon(delta) > whole.engine.epsilon(delta)
    copy = json.loads((tmp_path / "fork" / "checkpoint-6" / "privacy.json").read_text())
    assert copy["release"].startswith("a checkpoint's copy") and "NOT the run's final release" in copy["release"]


def test_a_run_resumed_at_its_last_step_trains_no_further(folders, dp_run, tmp_path):
    """checkpoint-6 is the run's last step (max_steps=6): resumed (a relaunched script), the
    Trainer's loop would take a step more before its callback stops it, spending privacy beyond the
    budget; DPTrainer refuses that step, and nothing is saved."""
    root, model_dir, data = folders
    script = _resuming(root / "dp" / "checkpoint-6")
    with pytest.raises(ValueError, match=r"has taken its 6 steps .*nothing was trained"):
        run(script, MODEL_DIR=model_dir, DATA=data, OUT=str(tmp_path / "again"), SEED=SEED)
    assert not (tmp_path / "again" / "checkpoint-7").exists()


def test_evaluating_on_the_training_data_is_refused(folders, tmp_path):
    """Evaluation metrics are logged beside ε without noise, as held-out data's: on the training
    rows themselves (the same dataset, or one with its fingerprint) they are refused, before any
    step when the Trainer would evaluate during training."""
    root, model_dir, data = folders
    script = PRIVATE.replace('eval_dataset=lm_dataset["test"]', 'eval_dataset=lm_dataset["train"]')
    assert script != PRIVATE
    with pytest.raises(ValueError, match=r"evaluation during training on the training data: .*without noise"):
        run(script, MODEL_DIR=model_dir, DATA=data, OUT=str(tmp_path / "eval"), SEED=SEED)
    assert not (tmp_path / "eval" / "checkpoint-3").exists()
    scope = run(PRIVATE.split("trainer.train()")[0], MODEL_DIR=model_dir, DATA=data, OUT=str(tmp_path / "e2"),
                SEED=SEED)
    train = scope["lm_dataset"]["train"]
    for rows in (train, {"mine": train}):
        with pytest.raises(ValueError, match="evaluate on the training data"):
            scope["trainer"].evaluate(rows)
    with pytest.raises(ValueError, match="predict on the training data"):
        scope["trainer"].predict(train)


@pytest.mark.parametrize("service", ["clearml", "flyte"])
def test_integrations_that_upload_checkpoint_folders_by_default_are_refused(service, folders, tmp_path,
                                                                             monkeypatch):
    """ClearML's callback uploads every checkpoint folder (the secret sampling key in it) unless
    CLEARML_LOG_MODEL says not to; Flyte's always syncs them."""
    monkeypatch.delenv("CLEARML_LOG_MODEL", raising=False)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[service], use_cpu=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folders[1])
    with pytest.raises(ValueError, match=rf"^DPTrainer: TrainingArguments\.report_to: {service} uploads checkpoint "
                                         "folders, which hold the secret sampling key"):
        DPTrainer(model=model, args=args, privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=4))
    if service == "clearml":
        monkeypatch.setenv("CLEARML_LOG_MODEL", "false")
        from longshield_fx.hf.arguments import refusals

        assert not refusals(args)


def test_the_trainers_privacy_json_has_the_clis_fields_and_labels(dp_run, folders):
    from longshield_fx.run_core import SAMPLE_RATE_DERIVED

    record = json.loads((folders[0] / "dp" / "final" / "privacy.json").read_text())
    assert {"epsilon", "delta", "delta_rule", "accountant", "privacy_unit", "mechanism", "sample_rate",
            "sample_rate_source", "noise_multiplier", "steps", "max_grad_norm", "clipping", "trained_parameters",
            "privacy_void", "insecure_seed", "release", "fork", "not_covered", "library"} <= set(record)
    assert record["sample_rate_source"] == SAMPLE_RATE_DERIVED and record["release"] == "final"
    assert "privacy_arguments" in record and record["fork"] is None
    assert "expected_batch_size" not in record["privacy_arguments"]  # with the derived q it would give N


def test_a_lora_model_trains_only_its_adapters_and_saves_a_peft_folder(folders, tmp_path):
    import peft
    _, model_dir, data = folders
    script = (PRIVATE.replace("max_steps=6", "max_steps=2").replace("eval_strategy=\"steps\"", "eval_strategy=\"no\"")
              .replace("model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)\n",
                       "model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)\n"
                       "import peft\nmodel = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="
                       "['q_proj', 'v_proj'], task_type='CAUSAL_LM'))\n"))
    trainer = run(script, MODEL_DIR=model_dir, DATA=data, OUT=str(tmp_path), SEED=SEED)["trainer"]
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    frozen = dict(base.named_parameters())
    for name, p in trainer.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[name.removeprefix("base_model.model.").replace(".base_layer", "")]), name
    reloaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "final")
    for (name, a), b in zip(trainer.model.named_parameters(), reloaded.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert "=unused" not in repr(trainer.engine), "an adapter got no gradient in the captured graph"
    assert all(not torch.equal(p, torch.zeros_like(p)) for n, p in trainer.model.named_parameters() if "lora_B" in n)


REFUSED = {
    "gradient_accumulation_steps": dict(gradient_accumulation_steps=2),
    "train_sampling_strategy": dict(train_sampling_strategy="group_by_length"),
    "auto_find_batch_size": dict(auto_find_batch_size=True),
    "torch_compile": dict(torch_compile=True),
    "neftune_noise_alpha": dict(neftune_noise_alpha=5.0),
    "label_smoothing_factor": dict(label_smoothing_factor=0.1),
    "include_num_input_tokens_seen": dict(include_num_input_tokens_seen=True),
    "dataloader_drop_last": dict(dataloader_drop_last=True),
    "push_to_hub": dict(push_to_hub=True, hub_model_id="x/y"),
    "fp16": dict(fp16=True),
    "enable_jit_checkpoint": dict(enable_jit_checkpoint=True),
    "report_to": dict(report_to=["mlflow"]),  # with HF_MLFLOW_LOG_ARTIFACTS set below
}


@pytest.mark.parametrize("option", list(REFUSED))
def test_training_arguments_dp_forbids_are_refused_by_name(option, folders, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MLFLOW_LOG_ARTIFACTS", "1")
    args = transformers.TrainingArguments(**{"output_dir": str(tmp_path), "report_to": "none", "use_cpu": True,
                                             **REFUSED[option]})
    model = transformers.AutoModelForCausalLM.from_pretrained(folders[1])
    with pytest.raises(ValueError, match=rf"^DPTrainer: TrainingArguments\.{option}: .+; "):
        DPTrainer(model=model, args=args, privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=4))


def test_privacy_arguments_need_one_noise_and_one_sampling_setting():
    with pytest.raises(ValueError, match="exactly one of target_epsilon"):
        PrivacyArguments(expected_batch_size=4)
    with pytest.raises(ValueError, match="exactly one of expected_batch_size"):
        PrivacyArguments(noise_multiplier=1.0, expected_batch_size=4, sample_rate=0.1)
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\], got 1.5"):
        PrivacyArguments(noise_multiplier=1.0, sample_rate=1.5)


def test_trl_sft_with_lora_on_text_and_chat_datasets_trains_privately(folders, tmp_path):
    """TRL's SFTTrainer through the same route: its own dataset preparation (a text dataset, then
    conversations through the chat template), a LoRA config; each example is one unit."""
    import trl
    import datasets
    import peft

    from longshield_fx.hf import DPSFTTrainer

    _, model_dir, _ = folders
    texts = ff.documents(24, seed=5)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    chats = [{"messages": [{"role": "user", "content": "notes?"}, {"role": "assistant", "content": t[:120]}]}
             for t in texts]
    for name, rows in (("text", [{"text": t[:200]} for t in texts]), ("chat", chats)):
        trainer = DPSFTTrainer(
            model=transformers.AutoModelForCausalLM.from_pretrained(model_dir),
            args=trl.SFTConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=2,
                               learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                               bf16=False),
            train_dataset=datasets.Dataset.from_list(rows), processing_class=tok,
            peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
            privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=6, insecure_seed=SEED))
        trainer.train()
        assert trainer.engine.accountant.steps == 2 and trainer.engine.captures == 1
        assert "=unused" not in repr(trainer.engine), "an adapter got no gradient in the captured graph"
        trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
        assert trained and all("lora_" in n for n in trained), trained
        assert [e["epsilon"] for e in trainer.state.log_history if "loss_not_dp" in e][-1] == \
            trainer.engine.epsilon(trainer.privacy_record()["delta"])
        trainer.save_model(str(tmp_path / name / "final"))
        assert (tmp_path / name / "final" / "adapter_config.json").is_file()


@pytest.mark.parametrize("option, value, why", [("packing", True, "privacy unit"), ("padding_free", True, "one row"),
                                                ("loss_type", "dft", "cross-entropy"),
                                                ("activation_offloading", True, "recomputes")])
def test_trl_options_that_change_the_unit_or_the_loss_are_refused(option, value, why, folders, tmp_path):
    import trl
    from longshield_fx.hf import DPSFTTrainer

    args = trl.SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **{option: value})
    with pytest.raises(ValueError, match=rf"^DPTrainer: TrainingArguments\.{option}: .*{why}"):
        DPSFTTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(folders[1]), args=args,
                     privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=4))


def test_a_custom_loss_is_refused(folders, tmp_path):
    with pytest.raises(ValueError, match="compute_loss_func is not supported"):
        DPTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(folders[1]),
                  args=transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True),
                  compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss,
                  privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=4))


def test_trl_in_bf16_is_refused_instead_of_training_a_copy(folders, tmp_path):
    """TRL replaces the model's forward by a function that holds the original; the bf16 capture's copy
    would run the original's weights, so the adapters would get no gradient: a clear error instead."""
    import trl
    import datasets
    import peft

    from longshield_fx.hf import DPSFTTrainer

    trainer = DPSFTTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(folders[1]),
        args=trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, bf16=True,
                           save_strategy="no", report_to="none", use_cpu=True),
        train_dataset=datasets.Dataset.from_list([{"text": t} for t in ff.documents(8, seed=1)]),
        processing_class=transformers.AutoTokenizer.from_pretrained(folders[1]),
        peft_config=peft.LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"),
        privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=4))
    with pytest.raises(lf.UnsupportedModelError, match="holds a module.+bf16=False"):
        trainer.train()


def _weights(folder) -> dict:
    return dict(transformers.AutoModelForCausalLM.from_pretrained(folder).named_parameters())


@pytest.mark.hf_trainer
def test_torchrun_dp2_cp2_fsdp_equals_one_process_and_resumes_on_2_ranks(distributed, folders, noiseless_run):
    """The same script under torchrun (run in the background: ``hf_trainer_script.py``): 4 gloo ranks
    as dp = 2 x cp = 2 with ZeRO-3 over both, and its checkpoint-3 resumed on 2 ranks (cp = 2,
    sharded over cp). Noise 0: both end at the one-process model within 1e-5; evaluation and the
    saved folder gather the shards. Every rank's gloo threads, running at the script's end, are
    joined at exit, before the interpreter finalizes (left running, one can abort a finished rank:
    ``_torch.destroy_process_groups``)."""
    out = distributed.hf_trainer()
    for run_dir, ranks in (("dp2cp2", 4), ("cp2", 2)):
        threads = out / run_dir / "gloo_threads"
        for rank in range(ranks):
            running = (threads / f"end-rank{rank}").read_text().split()
            assert "pt_gloo_runloop" in running and "gloo_tcp_loop" in running, (run_dir, rank, running)
            assert (threads / f"exit-rank{rank}").read_text().split() == [], (run_dir, rank)
    start = _weights(folders[1])
    for name, p in _weights(out / "model").items():  # the launch built the same model as this module
        assert torch.equal(p, start[name]), name
    one = dict(noiseless_run.model.named_parameters())
    assert max(float((one[n] - start[n]).detach().abs().max()) for n in one) > 1e-3  # the steps moved the model
    for run_dir in ("dp2cp2", "cp2"):
        for name, p in _weights(out / run_dir / "final").items():
            torch.testing.assert_close(p, one[name], rtol=0, atol=1e-5, msg=f"{run_dir}: {name}")
    state = json.loads((out / "cp2" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6 and any("eval_loss" in e for e in state["log_history"])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-compute", "bf16-compute"])
def test_a_bfloat16_model_trains_from_a_plain_list_of_rows(bf16, folders, tmp_path):
    """``dtype=torch.bfloat16`` weights, a list of dicts as the dataset, the default collator."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folders[1], dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(3, 300, (12, 16), generator=torch.Generator().manual_seed(0)).tolist()
    trainer = DPTrainer(model=model, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                        args=transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                                            max_steps=2, bf16=bf16, learning_rate=1e-2,
                                                            save_strategy="no", report_to="none", use_cpu=True),
                        privacy=PrivacyArguments(noise_multiplier=0.5, expected_batch_size=4, insecure_seed=SEED))
    trainer.train()
    assert trainer.engine.accountant.steps == 2 and "=unused" not in repr(trainer.engine)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="train\\(\\) ran before on this trainer"):
        trainer.train()


def test_a_unit_column_makes_each_persons_rows_one_unit_as_the_engine_loop_does(folders, tmp_path):
    """User-level DP: the rows of one ``person`` are one sample of (R, T) rows; the trainer's model
    equals the engine's loop over the same (units, R, T) tensor, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    sizes = [1, 3, 2, 1, 2, 3, 1, 2, 1, 2]  # rows per person
    rows = [{"person": f"p{u}", "input_ids": torch.randint(3, 300, (16,), generator=gen).tolist()}
            for u, n in enumerate(sizes) for _ in range(n)]
    rows = [dict(r, labels=r["input_ids"]) for r in rows[::2] + rows[1::2]]  # a person's rows apart
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3,
                                          learning_rate=1e-2, save_strategy="no", report_to="none", use_cpu=True,
                                          lr_scheduler_type="constant")
    model = transformers.AutoModelForCausalLM.from_pretrained(folders[1])
    trainer = DPTrainer(model=model, args=args, train_dataset=rows,
                        privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=3, unit_column="person",
                                                 insecure_seed=SEED))
    trainer.train()
    assert trainer.privacy_record()["privacy_unit"].startswith("all rows with one value of 'person'")

    units = list(dict.fromkeys(r["person"] for r in rows))
    R = max(sizes)
    ids = torch.zeros(len(units), R, 16, dtype=torch.long)
    labels = torch.full((len(units), R, 16), -100)
    for u, person in enumerate(units):
        mine = [r["input_ids"] for r in rows if r["person"] == person]
        ids[u, :len(mine)] = labels[u, :len(mine)] = torch.tensor(mine)
    lm = transformers.AutoModelForCausalLM.from_pretrained(folders[1])
    engine = lf.compile(lf.CausalLMLoss(lm), config=lf.DPConfig(1.0, 1.0, insecure_seed=SEED))
    optimizer = transformers.Trainer(model=lm, args=args).create_optimizer()
    sampler = lf.data.PoissonBatches(torch.utils.data.TensorDataset(ids, labels), 3 / len(units), 2,
                                     insecure_seed=SEED)
    draws = iter(sampler)
    for _ in range(3):
        batch = next(draws)
        for (x, y), mask in batch.physical:
            engine.accumulate(x, y, mask=mask)
        engine.finalize(batch)
        optimizer.step()
        lm.zero_grad()
    for (name, ours), theirs in zip(model.named_parameters(), lm.parameters(), strict=True):
        assert torch.equal(ours, theirs), name


def test_packed_documents_train_as_the_engine_loop_over_packed_batches(folders, tmp_path, capsys):
    """``pack_seq_len``: rows are documents of any length, packed into 4 x 32 physical batches (a
    logical batch's last may be 2 x 32), each document one unit; the trainer's model equals the
    engine's loop over ``PackedPoissonBatches`` of the same documents, bit for bit, and its logged
    loss is the loop's mean over the tokens predicted (a piece's first token predicts nothing)."""
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(3, 300, (int(n),), generator=gen).tolist()
            for n in torch.randint(4, 60, (24,), generator=gen)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3,
                                          learning_rate=1e-2, save_strategy="no", report_to="none", use_cpu=True,
                                          lr_scheduler_type="constant", logging_steps=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(folders[1])
    trainer = DPTrainer(model=model, args=args, train_dataset=[{"input_ids": d} for d in docs],
                        privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=8, pack_seq_len=32,
                                                 insecure_seed=SEED))
    trainer.train()
    said = re.search(r"DPTrainer: ε = (\S+), δ = 1e-05, PLD \(dp-accounting\) accountant, after 3 steps; the unit ε "
                     r"protects: one training row \(add/remove one row\)\. Non-finite per-unit gradients, "
                     r"contributing nothing \(NOT covered by DP\): 0\n", capsys.readouterr().out)
    assert said and float(said[1]) == pytest.approx(trainer.privacy_record()["epsilon"], abs=5e-4)
    # two graphs: of 4-row batches, and of the 2-row ones that end a logical batch
    assert trainer.engine.captures == 2 and trainer.privacy_record()["privacy_arguments"]["pack_seq_len"] == 32

    from longshield_fx.packing import PackedPoissonBatches, unit_slots_for

    lm = transformers.AutoModelForCausalLM.from_pretrained(folders[1]).train()
    U = unit_slots_for(4, 32, 8)  # the Trainer's: 16 per row at T = 32, at most 2·E + 8 = 24
    sampler = PackedPoissonBatches([[d] for d in docs], 8 / len(docs), seq_len=32, rows=4, unit_slots=U,
                                   pad_id=trainer.model.config.pad_token_id, insecure_seed=SEED)
    engine = lf.compile(lf.PackedCausalLMLoss(lm), config=lf.DPConfig(1.0, 1.0, insecure_seed=SEED), packed_units=U)
    optimizer = transformers.Trainer(model=lm, args=args).create_optimizer()
    draws = iter(sampler)
    losses = []
    for _ in range(3):
        batch = next(draws)
        loss, predicted = 0.0, 0
        for tensors, _ in batch.physical:
            loss += float(engine.accumulate(*tensors))
            ids, labels, positions, units = tensors
            predicted += int(((labels != -100) & (positions > 0)).sum())
        losses.append(loss / predicted)
        engine.finalize(batch)
        optimizer.step()
        lm.zero_grad()
    for (name, ours), theirs in zip(model.named_parameters(), lm.parameters(), strict=True):
        assert torch.equal(ours, theirs), name
    logged = [entry["loss_not_dp"] for entry in trainer.state.log_history if "loss_not_dp" in entry]
    assert logged == pytest.approx(losses, abs=1e-4)


def _lengths_seen(collate, seen: list):
    """``collate``, noting the length of each batch it returns."""
    def collated(features):
        batch = collate(features)
        seen.append(len(batch["input_ids"][0]))
        return batch
    return collated


def test_a_collator_padding_to_a_multiple_of_8_trains_in_one_shape(folders, tmp_path):
    """``pad_to_multiple_of=8``: a batch holding a row longer than 16 comes back 24 long, past the
    longest row (21); the padding columns past 21 are cut, the other batches padded to 21, so every
    physical batch has one shape. A collator that puts a real token past 21 is refused."""
    tok = transformers.AutoTokenizer.from_pretrained(folders[1])
    gen = torch.Generator().manual_seed(3)
    lengths = [21, *torch.randint(3, 21, (15,), generator=gen).tolist()]
    rows = [{"input_ids": torch.randint(4, 300, (n,), generator=gen).tolist()} for n in lengths]
    seen = []
    trainer = DPTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(folders[1]), train_dataset=rows,
                        data_collator=_lengths_seen(transformers.DataCollatorForLanguageModeling(
                            tok, mlm=False, pad_to_multiple_of=8), seen),
                        args=transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3,
                                                            max_steps=4, save_strategy="no", report_to="none",
                                                            use_cpu=True),
                        privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=6, insecure_seed=SEED))
    trainer.train()
    assert trainer.engine.accountant.steps == 4 and trainer.engine.captures == 1 and trainer._seq_len == 21
    assert 24 in seen and min(seen) < 21, seen  # both kinds of batch ran
    ids, labels = trainer._collated(list(range(6)))
    assert ids.shape == labels.shape == (6, 21) and torch.equal(ids[0], torch.tensor(rows[0]["input_ids"]))

    def one_more_token(features):  # a real token past the longest row
        longer = [{"input_ids": f["input_ids"] + [5] * (24 - len(f["input_ids"]))} for f in features]
        return {"input_ids": torch.tensor([f["input_ids"] for f in longer]),
                "labels": torch.tensor([f["input_ids"] for f in longer])}
    trainer._collate = one_more_token
    with pytest.raises(ValueError, match="^DPTrainer: the collator returned rows of 24 tokens with a real token .* "
                                         "past token 21, the length of the longest training row"):
        trainer._collated([0, 1])


def test_trl_sft_with_pad_to_multiple_of_8_trains_in_one_shape(folders, tmp_path):
    """TRL's ``SFTConfig(pad_to_multiple_of=8)`` over texts of random lengths: the same cut."""
    import datasets
    import trl

    from longshield_fx.hf import DPSFTTrainer

    rng = torch.Generator().manual_seed(4)
    texts = [t[:int(n)] for t, n in zip(ff.documents(16, seed=6), torch.randint(10, 90, (16,), generator=rng))]
    trainer = DPSFTTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(folders[1]),
        args=trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=4, pad_to_multiple_of=8,
                           save_strategy="no", report_to="none", use_cpu=True, bf16=False),
        train_dataset=datasets.Dataset.from_list([{"text": t} for t in texts]),
        processing_class=transformers.AutoTokenizer.from_pretrained(folders[1]),
        privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=6, insecure_seed=SEED))
    seen = []
    trainer.data_collator = _lengths_seen(trainer.data_collator, seen)
    trainer.train()
    assert trainer.engine.accountant.steps == 4 and trainer.engine.captures == 1
    assert trainer._seq_len % 8 and any(n > trainer._seq_len for n in seen), (trainer._seq_len, seen)


def _unit_trainer(folders, tmp_path, people: list, **privacy) -> DPTrainer:
    ids = torch.randint(3, 300, (len(people), 8), generator=torch.Generator().manual_seed(5)).tolist()
    return DPTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(folders[1]),
                     train_dataset=[{"person": p, "input_ids": r, "labels": r} for p, r in zip(people, ids)],
                     args=transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                                         max_steps=1, save_strategy="no", report_to="none",
                                                         use_cpu=True),
                     privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=1, unit_column="person",
                                              insecure_seed=SEED, **privacy))


def test_unit_ids_are_canonicalised_and_other_values_refused(folders, tmp_path):
    """One person spelled five ways is one unit, 5 and "5" one, "05" another (``canonical_unit_id``);
    a value that is neither a string nor an integer names no unit and is refused."""
    people = ["alice", 5, "Alice", " ALICE", "5", "ali\u200bce", "05", "ａｌｉｃｅ"]
    trainer = _unit_trainer(folders, tmp_path, people)
    trainer.get_train_dataloader()
    assert trainer._units == [[0, 2, 3, 5, 7], [1, 4], [6]]
    assert trainer.num_examples(trainer.get_train_dataloader()) == 3
    for i, bad in ((1, None), (2, 5.0), (1, True)):
        trainer = _unit_trainer(folders, tmp_path, ["bob", "carol", "dave"][:i] + [bad] + ["erin"])
        with pytest.raises(ValueError, match=rf"^DPTrainer: row {i} of the training set has person={bad!r} "
                                             rf"\({type(bad).__name__}\); .* must be strings or integers"):
            trainer.get_train_dataloader()


def test_packing_that_truncates_units_warns_with_the_counts(folders, tmp_path, caplog):
    """Persons with more documents than a physical batch has rows: packing keeps the longest
    ``per_device_train_batch_size`` pieces of each; the trainer says how many units and tokens
    (NOT covered by DP) and keeps the counts, which are ``PackedPoissonBatches``'s own."""
    from longshield_fx.packing import PackedPoissonBatches

    gen = torch.Generator().manual_seed(6)
    sizes = [1, 5, 2, 7, 3, 1]  # documents per person; 2 rows per physical batch
    rows = [{"person": f"p{u}", "input_ids": torch.randint(3, 300, (int(n),), generator=gen).tolist()}
            for u, k in enumerate(sizes) for n in torch.randint(4, 40, (k,), generator=gen)]
    trainer = DPTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(folders[1]), train_dataset=rows,
                        args=transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                                            max_steps=1, save_strategy="no", report_to="none",
                                                            use_cpu=True),
                        privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=2, unit_column="person",
                                                 pack_seq_len=16, insecure_seed=SEED))
    with caplog.at_level("WARNING", logger="longshield_fx.hf"):
        trainer.get_train_dataloader()
    own = PackedPoissonBatches([[r["input_ids"] for r in rows if r["person"] == f"p{u}"] for u in range(len(sizes))],
                               0.5, seq_len=16, rows=2, unit_slots=8)
    assert (trainer.truncated_units, trainer.dropped_tokens) == (own.truncated_units, own.dropped_tokens)
    assert own.truncated_units >= 3 and own.dropped_tokens > 0
    said = [r.getMessage() for r in caplog.records if r.name == "longshield_fx.hf" and r.levelname == "WARNING"]
    assert len(said) == 1 and said[0].startswith(
        f"DPTrainer: {own.truncated_units} units truncated ({own.dropped_tokens} tokens dropped): packing keeps at "
        "most per_device_train_batch_size=2 rows of pack_seq_len=16 tokens"), said
    assert "NOT covered by DP" in said[0] and "raise per_device_train_batch_size" in said[0]


def test_packed_rows_are_cut_to_their_attention_mask_and_one_row_batches_refused(folders, tmp_path, caplog):
    """Rows tokenized with padding="max_length": packing trains the tokens the mask keeps, never
    the padding (labels -100 there, as a collator would set them); a left-padded row and a
    physical batch of one row are refused by name before anything is compiled. The isolation
    probe runs when the trainer is set up, on random documents, whatever the first draw holds."""
    def trainer(rows, batch_rows=2):
        return DPTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(folders[1]), train_dataset=rows,
                         args=transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none",
                                                             per_device_train_batch_size=batch_rows,
                                                             save_strategy="no", use_cpu=True),
                         privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=2, pack_seq_len=16,
                                                  insecure_seed=SEED))

    def padded(ids, length=12, left=False):
        pad = [0] * (length - len(ids))
        mask = [1] * len(ids)
        return {"input_ids": pad + ids if left else ids + pad, "attention_mask": [0] * len(pad) + mask if left
                else mask + [0] * len(pad), "labels": [-100] * len(pad) + ids if left else ids + [-100] * len(pad)}

    rows = [padded(list(range(3, 3 + n))) for n in (5, 9, 12, 3)]
    packed = trainer(rows)
    with caplog.at_level("INFO", logger="longshield_fx"):
        packed.get_train_dataloader()
    assert "the packed isolation probe passed" in caplog.text and packed.engine.captures == 1
    assert [packed._document(i) for i in range(4)] == [list(range(3, 3 + n)) for n in (5, 9, 12, 3)]
    with pytest.raises(ValueError, match="row 1's is not; tokenize with tokenizer.padding_side = 'right'"):
        trainer([rows[0], padded([4, 5, 6], left=True)]).get_train_dataloader()
    one_row = trainer(rows, batch_rows=1)
    with pytest.raises(ValueError, match="per_device_train_batch_size rows of pack_seq_len tokens, at least 2"):
        one_row.get_train_dataloader()
    assert one_row.engine is None


def test_data_parallel_over_several_gpus_of_one_process_is_refused(folders, tmp_path, monkeypatch):
    """``n_gpu > 1`` (the Trainer would wrap the model in DataParallel): one process per GPU instead.
    No machine here has two GPUs, so the property says so."""
    monkeypatch.setattr(transformers.TrainingArguments, "n_gpu", property(lambda self: 2))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match=r"^DPTrainer: TrainingArguments\.n_gpu > 1 \(DataParallel\): .*torchrun"):
        DPTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(folders[1]), args=args,
                  privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=4))
