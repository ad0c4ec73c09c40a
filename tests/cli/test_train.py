"""``longshield-fx train``: a short run, checkpoints and resume, privacy of what it writes.

- a short training run writes metrics, the loss-vs-ε plot and a summary, and reports ε <= target,
  per document, at δ = the largest power of ten <= min(1e-5, N^-1.1), with the PLD accountant;
- privacy: ``--seed`` seeds the model only (same seed: same initial model, different noise);
  ``--insecure-seed`` is loud, recorded and reproducible; one corpus row per document, truncation
  reported; losses and counts only under ``not_covered_by_dp``, batch sizes only with
  ``--log-private-stats``;
- checkpoints (SECRET: the sampling key; never the noise key): a run SIGKILLed while writing a
  checkpoint, then ``--resume``, redoes the lost steps on the same batches with fresh noise; temp
  and damaged files are never loaded; a checkpoint of a different run is refused by name;
- under torchrun (dp = 2, cp = 2, dp x cp with ZeRO-3) a run is the one process's run: the same ε,
  printed once, the same batches and losses; a killed rank's run restarts from its checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import warnings

import pytest
import torch

from cli_runs import (FAST, SHORT, assert_bit_identical, env, load_state, metric_rows, printed_deprecations,
                      reported_epsilon, run_cli, run_in_process, train_losses)
from longshield_fx import cli
from oracles import log_excerpt
from longshield_fx.cli.checkpoints import atomic_save, list_checkpoints
from longshield_fx.cli.corpus import stdlib_corpus, stdlib_files
from longshield_fx.run_core import DELTA_RULE, default_delta


# --- train ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """12 steps at T=128 with a checkpoint every 2 steps (the newest 2 are kept), σ calibrated
    to the default target ε with the default (PLD) accountant."""
    root = tmp_path_factory.mktemp("short")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_in_process([*SHORT, "--out", "run"], root)
    assert res.returncode == 0, res.stderr[-3000:]
    res.warnings = printed_deprecations(caught)
    return root / "run", res


def test_a_run_and_the_process_group_teardown_print_no_deprecation_warning(short_run, tmp_path):
    """Nothing of torch's or transformers' deprecations reaches a user's console: not in a default
    run, nor from the teardown every torchrun rank ends with (it printed torch's ``reduce_op``
    FutureWarning twice per rank). --lora's: ``test_finetune``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    assert short_run[1].warnings == []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli.tear_down_processes(finished=True)
    assert not dist.is_initialized()
    assert printed_deprecations(caught) == []


def test_train_writes_metrics_plot_and_epsilon_within_target(short_run):
    run, res = short_run
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(loss is None or 0 < loss < 10 for loss in train_losses(rows))
    eps, rest = reported_epsilon(res.stdout)
    assert 0 < eps <= 8.0 and "<= target 8" in rest
    assert rows[-1]["epsilon"] == pytest.approx(eps, abs=1e-3)
    assert json.loads((run / "summary.json").read_text())["epsilon"] <= 8.0
    png = (run / "loss_vs_epsilon.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt-00000010.pt", "ckpt-00000012.pt"]
    assert (run / "final_model.pt").is_file()
    assert "loss/token (NOT covered by DP):" in res.stdout and "train" in res.stderr  # summary and progress bar


# Runs the CLI and SIGKILLs its own process half-way through writing the checkpoint of step
# KILL_AT (after half the bytes reached the temp file): a kill at a fixed point of the run, not
# a race between a poll and the run.
KILLED_WHILE_SAVING = """
import io, os, signal, sys, torch
from longshield_fx.cli import main
kill_at, real_save = int(sys.argv[1]), torch.save
# Under torchrun: rank 0 of the first attempt only (a relaunch must get through).
first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ.get("RANK", "0") == "0"
def save(obj, f, *args, **kwargs):
    if first and isinstance(obj, dict) and obj.get("step") == kill_at:
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)
torch.save = save
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_a_run_cut_back_to_an_older_checkpoint_resumes_only_as_a_fork_whose_epsilon_counts_every_branch(
        short_run, tmp_path):
    """The short run's copy is cut back to its step-10 checkpoint (the newer one deleted, as an
    attacker or a careless user would): --resume is refused in one line naming step 12, which the
    run ledger holds, and nothing changes. With --fork the resumed run is SIGKILLed while writing
    the step-12 checkpoint (steps 11-12 done, a half temp file left: a save cut before the file was
    whole, so its steps were never saved and the ledger does not hold them); a damaged file
    under a complete name (ckpt-00000012.pt) is planted; forking again redoes steps 11-12 from the
    step-10 model on the same batches (the checkpoint holds the secret sampling stream): step 11's
    loss is the uninterrupted run's, the final model differs (a resumed engine never reuses the
    noise key), and ε counts steps 11 and 12 as the same subsampled batches released twice (σ/√2),
    equal to dp-accounting's own PLD accountant over that history."""
    import dp_accounting

    run, _ = short_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ckpts = copy / "checkpoints"
    (ckpts / "ckpt-00000012.pt").unlink()
    (copy / "final_model.pt").unlink()
    ledger = (copy / "privacy_ledger.jsonl").read_text()
    assert [json.loads(line)["step"] for line in ledger.splitlines()] == list(range(1, 13))

    refused = run_in_process([*SHORT, "--resume", copy], tmp_path)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "records step 12, released" in refused.stderr and "ckpt-00000010.pt, is at step 10" in refused.stderr
    assert "--fork" in refused.stderr and (copy / "privacy_ledger.jsonl").read_text() == ledger
    assert len(metric_rows(copy)) == 12 and not (copy / "final_model.pt").exists()

    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_SAVING, "12", *map(str, SHORT), "--resume", copy,
                             "--fork"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env(),
                            check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "ckpt-00000010.pt at step 10/12" in killed.stdout
    assert [r["step"] for r in metric_rows(copy)] == list(range(1, 13))  # rows 11, 12 written before the kill
    temp = [p.name for p in ckpts.iterdir() if p.name.startswith(".ckpt-00000012.pt.tmp-")]
    assert len(temp) == 1 and not (copy / "final_model.pt").exists()
    assert (copy / "privacy_ledger.jsonl").read_text() == ledger
    # A damaged file under a complete name is skipped for an older one.
    (ckpts / "ckpt-00000012.pt").write_bytes((ckpts / "ckpt-00000010.pt").read_bytes()[:1000])

    res = run_in_process([*SHORT, "--resume", copy, "--fork"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and "ckpt-00000010.pt at step 10/12" in res.stdout
    assert "skipped unreadable checkpoint(s) ckpt-00000012.pt" in res.stdout + res.stderr
    uninterrupted, resumed = load_state(run / "final_model.pt"), load_state(copy / "final_model.pt")
    changed = sum(int((uninterrupted[k] != resumed[k]).sum()) for k in resumed)
    assert changed > 0.5 * sum(v.numel() for v in resumed.values())  # fresh noise in steps 11 and 12
    before, after = metric_rows(run), metric_rows(copy)

    def losses(rows):
        return [(r["step"], r["not_covered_by_dp"]["train_loss"], r["not_covered_by_dp"]["nonfinite_samples"])
                for r in rows]

    # The killed run's rows 11, 12 were dropped and redone: step 11 from the same model and batch.
    assert losses(before)[:11] == losses(after)[:11] and len(after) == 12
    assert [r["epsilon"] for r in after[:10]] == pytest.approx([r["epsilon"] for r in before[:10]], rel=1e-8)
    summary = json.loads((copy / "summary.json").read_text())
    sigma, q, delta = summary["sigma"], summary["sample_rate"], summary["delta"]
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), 10)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma / 2 ** 0.5)), 2)
    assert after[-1]["epsilon"] == summary["epsilon"] == pytest.approx(accountant.get_epsilon(delta), rel=1e-6)
    assert summary["epsilon"] > before[-1]["epsilon"]
    privacy = json.loads((copy / "privacy.json").read_text())
    assert privacy["epsilon"] == summary["epsilon"] and privacy["fork"]["steps_released_by_other_branches"] == 2
    assert privacy["release"] == "final"


def test_the_same_command_after_its_newer_checkpoints_were_lost_is_refused_unless_forked(short_run, tmp_path):
    """The same command continued in its --out (no --resume) meets the ledger too; a new run in an
    --out whose ledger holds another run's steps, with no checkpoint left, is refused as well."""
    run, _ = short_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "checkpoints" / "ckpt-00000012.pt").unlink()
    same = run_in_process([*SHORT, "--out", copy], tmp_path)
    assert same.returncode == 2 and "records step 12, released" in same.stderr, same.stderr
    for ckpt in (copy / "checkpoints").iterdir():
        ckpt.unlink()
    for name in ("summary.json", "final_model.pt", "metrics.jsonl", "privacy.json", "signature.json"):
        (copy / name).unlink()
    over = run_in_process([*SHORT, "--out", copy], tmp_path)
    assert over.returncode == 2 and "starting over, is at step 0" in over.stderr, over.stderr


def test_resume_into_another_out_goes_on_from_there_when_the_same_command_runs_again(short_run, tmp_path):
    """``--resume OLD --out NEW`` writes its checkpoints into NEW; the same command again (a
    restart, or what the stop message advises) goes on from NEW's newer checkpoint, where OLD's
    older one alone would be refused by the ledger. Another run's checkpoints in NEW are refused."""
    run, _ = short_run
    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(run, old)
    shutil.copytree(run, new)
    (old / "checkpoints" / "ckpt-00000012.pt").unlink()  # OLD stopped at 10; the session in NEW took 11-12
    again = run_in_process(["train", "--resume", old, "--out", new], tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from {new / 'checkpoints' / 'ckpt-00000012.pt'} at step 12/12" in again.stdout + again.stderr
    ckpt = new / "checkpoints" / "ckpt-00000012.pt"
    state = torch.load(ckpt, weights_only=True)
    state["signature"]["corpus"]["not_covered_by_dp"]["documents"] += 1
    torch.save(state, ckpt)
    other = run_in_process(["train", "--resume", old, "--out", new], tmp_path)
    assert other.returncode == 2 and "holds checkpoints of another run" in other.stderr, other.stderr


@pytest.mark.parametrize("change, named", [
    (["-T", "256"], "--seq-len 256 (the run has 128): this flag differs"),
    (["-T", "128", "--clipping", "per_layer"], "--clipping 'per_layer' (the run has 'flat'): this flag differs"),
    (["-T", "128", "--model", "small"], "--model 'small' (the run has 'tiny')"),
])
def test_resume_refuses_a_flag_that_differs_from_the_run_by_name(short_run, tmp_path, capsys, change, named):
    run, _ = short_run
    code = cli.main(["train", "--steps", "12", "--save-every", "2", *FAST, *change, "--resume", str(run),
                     "--out", str(tmp_path / "other")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert named in err, err
    assert not (tmp_path / "other").exists()


def test_resume_refuses_a_checkpoint_whose_data_changed(short_run, tmp_path, capsys):
    """The flags are the run's own, but the checkpoint's signature says it saw other data."""
    run, _ = short_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ckpt = copy / "checkpoints" / "ckpt-00000012.pt"
    state = torch.load(ckpt, weights_only=True)
    state["signature"]["corpus"]["not_covered_by_dp"]["documents"] += 1
    torch.save(state, ckpt)
    assert cli.main(["train", "--resume", str(copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert "refusing to resume" in err and "corpus.not_covered_by_dp.documents" in err, err


# --- privacy of what train writes and prints -----------------------------------------------

def test_epsilon_is_per_document_at_delta_well_below_one_over_n_with_pld(short_run):
    run, res = short_run
    n = stdlib_corpus(128, 60).num_documents
    summary = json.loads((run / "summary.json").read_text())
    assert summary["delta"] == default_delta(n) == 1e-5 < 1 / n
    assert summary["delta_rule"] == DELTA_RULE and summary["accountant"] == "pld"
    assert summary["privacy_unit"] == "document (add/remove one document)"
    assert re.search(r"privacy: ε = [0-9.]+ per document \(add/remove one document\), δ = 1e-05, PLD accountant "
                     r"<= target 8", res.stdout), res.stdout
    assert f"δ = 1e-05 (the largest power of ten <= min(1e-5, N^-1.1) for N = {n} documents, well below 1/N" \
        in res.stdout
    assert summary["insecure_seed"] is None and not summary["privacy_void"] and "WARNING" not in res.stdout


def test_default_delta_is_a_power_of_ten_below_min_of_1e5_and_n_to_the_minus_1_1():
    """A power of ten: δ is published, and then tells N's order of magnitude at most."""
    assert default_delta(60) == 1e-5 and default_delta(35111) == 1e-5 and default_delta(35112) == 1e-6
    assert default_delta(10 ** 6) == 1e-7
    for n in (1, 10, 10 ** 5, 10 ** 6 + 1, 10 ** 9):
        d = default_delta(n)
        assert d < 1 / n and n * d <= n ** -0.1 * (1 + 1e-12) and d <= min(1e-5, n ** -1.1)
        assert d == 10.0 ** round(math.log10(d)) and 10 * d > min(1e-5, n ** -1.1)


def test_help_says_what_seed_delta_accountant_and_checkpoints_mean():
    parser = cli.build_parser()
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    helps = {a.dest: a.help for a in train._actions}
    assert "initialisation and dropout ONLY" in helps["seed"] and "never use it" in helps["seed"]
    assert "min(1e-5, N^-1.1)" in helps["delta"] and "well below 1/N" in helps["delta"]
    assert "SECRET" in helps["out"] and "SECRET" in helps["resume"] and "SECRET" in train.description
    assert "VOIDS THE PRIVACY GUARANTEE" in helps["insecure_seed"] and train.get_default("insecure_seed") is None
    assert train.get_default("accountant") == "pld"
    assert "NOT covered by ε" in helps["log_private_stats"] and not train.get_default("log_private_stats")


def _flag_help(flag: str) -> str:
    action = next(a for a in cli.build_parser().commands["train"]._actions if flag in a.option_strings)
    return " ".join(action.help.split())


def test_each_flag_help_says_what_the_flag_does_where_the_two_had_drifted(capsys):
    """--no-pack (packing is the default under --fsdp too: test_torchrun_packed_documents_...), --model
    (the sizes and positions it states, no timing it cannot keep), --data (binary files), --save-every
    (a checkpoint on a signal: test_a_signal_saves_...); the tiny model's positions checked against T."""
    from longshield_fx.cli.models import check_positions
    from longshield_fx.models import CONFIGS, Llama

    no_pack = _flag_help("--no-pack")
    assert "--fsdp" in no_pack and "padded layout is used" not in no_pack
    model = _flag_help("--model")
    tiny, small = (sum(p.numel() for p in Llama.from_name(n).parameters()) for n in ("tiny", "small"))
    assert f"'tiny' has {round(tiny / 1e3)}k parameters and positions for T <= {CONFIGS['tiny'].max_seq_len}" in model
    assert f"'small' {small / 1e6:.1f}M and T <= {CONFIGS['small'].max_seq_len}" in model
    assert "minutes" not in model and "s per step" not in model  # timings live where they were measured
    default_T = cli.build_parser().parse_args(["train"]).seq_len
    check_positions(Llama.from_name("tiny"), default_T)
    assert capsys.readouterr().out == ""  # the default run: no warning
    check_positions(Llama.from_name("tiny"), 2 * CONFIGS["tiny"].max_seq_len)
    assert f"WARNING: --seq-len {2 * CONFIGS['tiny'].max_seq_len} is longer than the reference model's max_seq_len" \
        in capsys.readouterr().out
    assert "mostly NUL or control bytes, are skipped, counted and named" in _flag_help("--data")
    assert "when Ctrl-C or SIGTERM stops the run" in _flag_help("--save-every")


def test_same_seed_gives_the_same_initial_model_but_different_noise(tmp_path, capsys):
    """q = 1 (every document in every batch, so the batches cannot differ) and σ = 1, one step, same
    --seed. One AdamW step moves each coordinate by at most lr, so two runs that end at most 2·lr apart
    started from the same model; that they differ at all is the noise (the tiny Llama has no dropout).
    --insecure-seed (tests only) is loud, recorded, and reproducible by anyone: two runs with it are
    bit-identical. (RDP: the accountant is not the point.)"""
    T, files, lr = 32, 8, 2e-3
    n = stdlib_corpus(T, files).num_documents
    common = ["train", "--steps", 1, "-T", T, "--max-files", files, "--expected-batch-size", n,
              "--physical-batch-size", n, "--sigma", 1, "--lr", lr, "--save-every", 0, "--seed", 0,
              "--accountant", "rdp"]
    extra = {"a": [], "b": [], "c": ["--insecure-seed", 5], "d": ["--insecure-seed", 5]}
    out = {}
    for k, v in extra.items():
        assert cli.main([str(x) for x in common + v] + ["--out", str(tmp_path / k)]) == 0
        out[k] = capsys.readouterr().out
    a, b = (load_state(tmp_path / k / "final_model.pt") for k in "ab")
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    changed = sum(int((a[k] != b[k]).sum()) for k in a) / sum(v.numel() for v in a.values())
    assert 0 < diff <= 2 * lr * 1.001, diff  # same initial model ...
    assert changed > 0.25, changed  # ... different noise on most coordinates
    # The public seed regenerates the same noise (and batches): anyone can subtract it.
    assert_bit_identical(*(load_state(tmp_path / k / "final_model.pt") for k in "cd"))
    # The escape hatch is loud and recorded.
    assert "WARNING" not in out["a"]
    assert "WARNING: --insecure-seed 5" in out["c"] and "NO privacy guarantee" in out["c"]
    assert "VOID: --insecure-seed 5" in reported_epsilon(out["c"])[1]
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert summary["insecure_seed"] == 5 and summary["privacy_void"] is True
    assert json.loads((tmp_path / "c" / "signature.json").read_text())["dp"]["insecure_seed"] == 5


def test_corpus_is_one_row_per_document_with_truncation_reported(short_run):
    import longshield_fx as lf
    from longshield_fx.models import Llama

    T = 512
    corpus = stdlib_corpus(T, 60)
    files = [f.read_bytes() for f in stdlib_files(60)]
    docs = [d for d in files if len(d) >= 2]
    assert corpus.num_documents == len(docs) == corpus.ids.shape[0] == corpus.labels.shape[0]
    assert corpus.skipped == len(files) - len(docs)
    for i, doc in enumerate(docs):
        n = min(len(doc), T)
        assert bytes(corpus.ids[i, :n].tolist()) == doc[:n]
        assert torch.equal(corpus.labels[i, :n], corpus.ids[i, :n]) and bool((corpus.labels[i, n:] == -100).all())
    assert corpus.truncated == sum(len(d) > T for d in docs) and 0 < corpus.truncated < len(docs)
    assert corpus.fraction_used == pytest.approx(sum(min(len(d), T) for d in docs) / sum(map(len, docs)))
    # The padding of a short document contributes nothing: its loss is that of the document alone.
    i = next(i for i, d in enumerate(docs) if len(d) < T)
    n = len(docs[i])
    torch.manual_seed(0)
    model = lf.CausalLMLoss(Llama.from_name("tiny"))
    with torch.no_grad():
        padded = model(corpus.ids[i:i + 1], corpus.labels[i:i + 1])
        alone = model(corpus.ids[i:i + 1, :n], corpus.ids[i:i + 1, :n])
    assert float(padded) == pytest.approx(float(alone), rel=1e-5)

    # train reports it (the short run: T = 128, 60 files).
    run, res = short_run
    c = stdlib_corpus(128, 60)
    assert (f"corpus: {c.num_documents} documents (one stdlib file per row, its first 128 bytes; the privacy unit "
            f"is the document); {c.truncated} truncated to 128 bytes, {c.fraction_used:.1%} of the corpus bytes "
            "used") in res.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert "corpus" not in summary and summary["not_covered_by_dp"]["corpus"]["documents"] == c.num_documents
    assert summary["not_covered_by_dp"]["corpus"]["truncated_documents"] == c.truncated
    assert summary["not_covered_by_dp"]["corpus"]["bytes_used_fraction"] == pytest.approx(c.fraction_used, abs=1e-6)


def test_default_outputs_hold_no_batch_size_and_label_what_dp_does_not_cover(short_run):
    run, res = short_run
    for row in metric_rows(run):
        assert set(row) == {"step", "epsilon", "delta", "sigma", "not_covered_by_dp"}, row
        assert set(row["not_covered_by_dp"]) == {"train_loss", "nonfinite_samples", "elapsed_s"}, row
    summary = json.loads((run / "summary.json").read_text())
    assert not [k for k in summary if re.search("loss|token|nonfinite|wall|per_step", k)], summary
    private = summary["not_covered_by_dp"]
    assert private["nonfinite_samples"] == 0 and private["train_loss_last"] > 0
    text = (run / "metrics.jsonl").read_text() + json.dumps(summary)
    assert "batch_size\": " not in text.replace("expected_batch_size\": ", "") and "tokens" not in text
    assert "training loss/token (NOT covered by DP):" in res.stdout
    assert "non-finite per-sample gradients (NOT covered by DP): 0" in res.stdout


def test_log_private_stats_writes_batch_sizes_labelled_and_the_plot_says_loss_is_not_covered(
        tmp_path, capsys, monkeypatch):
    from longshield_fx.tools import plots

    seen = {}
    real = plots.loss_vs_epsilon

    def spy(rows, path, title=""):
        seen.update(rows=rows, title=title)
        return real(rows, path, title)

    monkeypatch.setattr(plots, "loss_vs_epsilon", spy)
    assert cli.main(["train", "--steps", "3", "-T", "32", "--sigma", "1", "--save-every", "0", *FAST,
                     "--accountant", "rdp", "--log-private-stats", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "losses: NOT covered by DP" in seen["title"] and "per document" in seen["title"]
    rows = metric_rows(tmp_path)
    assert [r["loss"] for r in seen["rows"]] == train_losses(rows)
    for row in rows:
        private = row["not_covered_by_dp"]
        assert set(private) == {"train_loss", "nonfinite_samples", "elapsed_s", "logical_batch_size", "tokens",
                                "tokens_per_s"}
        assert "logical_batch_size" not in row and "tokens" not in row
        assert (private["train_loss"] is None) == (private["logical_batch_size"] == 0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["not_covered_by_dp"]["tokens"] == rows[-1]["not_covered_by_dp"]["tokens"] > 0
    assert "tokens/s (NOT covered by DP)" in out


def test_checkpoints_hold_the_secret_sampling_stream_and_never_the_noise_key(short_run):
    run, _ = short_run
    state = load_state(run / "checkpoints" / "ckpt-00000012.pt")
    sampling = state["sampler"]["stream"]
    assert state["sampler"]["step"] == 12 and sampling["draws"] == 12 and len(sampling["key"]) == 32
    assert set(state["engine"]) == {"accountant", "nonfinite_samples", "config"}
    assert state["engine"]["accountant"]["history"][0][2] == 12


def _cut_back_to_step_10(run, copy):
    """The short run as it was when it stopped after its step-10 checkpoint: steps 11-12, never
    saved or released, are not in its ledger either."""
    shutil.copytree(run, copy)
    (copy / "checkpoints" / "ckpt-00000012.pt").unlink()
    (copy / "final_model.pt").unlink()
    _cut_ledger(copy, 10)
    return {p.name: p.read_bytes() for p in (copy / "checkpoints").iterdir()}


def _cut_ledger(run, step):
    """The run's ledger as it was when the run stopped after ``step``."""
    ledger = run / "privacy_ledger.jsonl"
    ledger.write_text("".join(line + "\n" for line in ledger.read_text().splitlines() if json.loads(line)["step"] <= step))


def test_the_same_command_in_its_out_continues_its_run_and_another_run_there_is_refused(short_run, tmp_path):
    """A run stopped after its step-10 checkpoint: another command in its --out is refused in one
    line naming --resume and a new --out, and deletes nothing; the run's own command (as torchrun
    --max-restarts relaunches it) continues it from step 10."""
    run, _ = short_run
    copy = tmp_path / "run"
    before = _cut_back_to_step_10(run, copy)
    other = run_in_process([*SHORT[:4], 64, *SHORT[5:], "--out", copy], tmp_path)  # -T 64 instead of 128
    assert SHORT[3:5] == ["-T", 128]
    assert other.returncode == 2
    lines = [line for line in other.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "holds another run's checkpoints (seq_len: 128 in the checkpoint, 64 now" in lines[0]
    assert f"--resume {copy}" in lines[0] and "new --out" in lines[0] and "nothing was changed" in lines[0]
    assert {p.name: p.read_bytes() for p in (copy / "checkpoints").iterdir()} == before
    same = run_in_process([*SHORT, "--out", copy], tmp_path)
    assert same.returncode == 0, same.stderr[-2000:]
    assert "resumed from" in same.stdout and "ckpt-00000010.pt at step 10/12" in same.stdout
    assert [r["step"] for r in metric_rows(copy)] == list(range(1, 13))


def test_resume_alone_takes_the_runs_own_flags_and_refuses_a_differing_one_by_name(short_run, tmp_path):
    run, _ = short_run
    copy = tmp_path / "run"
    _cut_back_to_step_10(run, copy)
    differing = run_in_process(["train", "--resume", copy, "--lr", 0.5, "-T", 128], tmp_path)
    assert differing.returncode == 2
    assert "--lr 0.5 (the run has 0.002)" in differing.stderr and "-T" not in differing.stderr.split("differ")[0]
    alone = run_in_process(["train", "--resume", copy], tmp_path)
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert "ckpt-00000010.pt at step 10/12" in alone.stdout and "T=128" in alone.stdout
    assert [r["step"] for r in metric_rows(copy)] == list(range(1, 13))


def test_an_out_holding_outputs_without_checkpoints_is_refused_unless_it_is_the_same_run(tmp_path):
    job = ["train", "--steps", 1, "-T", 32, *FAST, "--sigma", 1, "--accountant", "rdp", "--save-every", 0,
           "--out", tmp_path / "run"]
    assert run_in_process(job, tmp_path).returncode == 0
    summary = (tmp_path / "run" / "summary.json").read_bytes()
    other = run_in_process([*job, "--lr", 0.01], tmp_path)
    assert other.returncode == 2 and "already holds another run's outputs" in other.stderr
    assert (tmp_path / "run" / "summary.json").read_bytes() == summary
    # The same run, which never wrote a checkpoint but released its model (step 1 is in the ledger):
    # starting it over would release a second branch, so only a fork does.
    again = run_in_process(job, tmp_path)
    assert again.returncode == 2 and "records step 1, released" in again.stderr, again.stderr
    assert (tmp_path / "run" / "summary.json").read_bytes() == summary
    again = run_in_process([*job, "--fork"], tmp_path)
    assert again.returncode == 0 and "starting it over" in again.stdout
    assert json.loads((tmp_path / "run" / "privacy.json").read_text())["fork"]["steps_released_by_other_branches"] == 1


def test_an_interrupted_run_says_how_to_continue_it(tmp_path, monkeypatch):
    from longshield_fx.cli import train_loop

    real = train_loop._one_step

    def interrupt_at_step_3(job, logical, step):
        if step == 3:
            raise KeyboardInterrupt
        return real(job, logical, step)

    monkeypatch.setattr(train_loop, "_one_step", interrupt_at_step_3)
    res = run_in_process(["train", "--steps", 4, "-T", 32, *FAST, "--sigma", 1, "--accountant", "rdp",
                          "--save-every", 2, "--out", tmp_path / "run"], tmp_path)
    assert res.returncode == 130
    assert (f"interrupted after step 2; the newest checkpoint is ckpt-00000002.pt: continue with the same command, "
            f"or longshield-fx train --resume {tmp_path / 'run'}") in res.stderr


def test_a_signal_saves_the_finished_step_and_the_same_command_continues_with_timings_of_its_own(tmp_path,
                                                                                                   monkeypatch):
    """SIGTERM during step 2, then Ctrl-C (SIGINT) during step 4, both before the first --save-every
    checkpoint: each step finishes and is checkpointed before the exit, and the same command continues
    from it. The metrics hold every step once, ε is the uninterrupted 6 steps', summary.json's timings
    count the steps the last session ran and say it resumed; a rerun of the finished run keeps its outputs."""
    import os

    from longshield_fx.cli import train_loop
    from longshield_fx.runtime.accounting import epsilon_for

    real, signal_at = train_loop._one_step, {}

    def signalled_during(job, logical, step):
        if step in signal_at:
            os.kill(os.getpid(), signal_at.pop(step))  # the handler only notes it: the step runs on
        return real(job, logical, step)

    monkeypatch.setattr(train_loop, "_one_step", signalled_during)
    run = tmp_path / "run"
    args = ["train", "--steps", 6, "-T", 32, *FAST, "--sigma", 1, "--accountant", "rdp", "--out", run]
    signal_at[2] = signal.SIGTERM
    res = run_in_process(args, tmp_path)
    assert res.returncode == 143, res.stderr[-2000:]
    assert ("stopped by SIGTERM after step 2/6; checkpoint ckpt-00000002.pt: the same command continues from step 2"
            in res.stderr)
    signal_at[4] = signal.SIGINT
    res = run_in_process(args, tmp_path)
    assert res.returncode == 130 and "stopped by SIGINT after step 4/6" in res.stderr, res.stderr[-2000:]
    assert [p.name for _, p in list_checkpoints(run / "checkpoints")] == ["ckpt-00000004.pt", "ckpt-00000002.pt"]
    res = run_in_process(args, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "done: steps 5-6 of 6 (resumed at step 4;" in res.stdout
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    summary = json.loads((run / "summary.json").read_text())
    assert rows[-1]["epsilon"] == summary["epsilon"] == pytest.approx(
        epsilon_for(1.0, summary["sample_rate"], 6, summary["delta"], "rdp"), rel=1e-9)
    assert summary["session"] == {"started_at_step": 4, "steps_run": 2, "resumed": True, "already_finished": False}
    timing = summary["not_covered_by_dp"]
    assert timing["s_per_step"] == pytest.approx(timing["training_s"] / 2, abs=0.01)  # rounded to 0.01 s
    assert timing["training_s_all_sessions"] > timing["training_s"]

    again = run_in_process(args, tmp_path)  # the finished run, run again: nothing to do, nothing rewritten
    assert again.returncode == 0 and "had already finished (step 6/6)" in again.stdout, again.stdout
    assert json.loads((run / "summary.json").read_text()) == summary
    assert reported_epsilon(again.stdout)[0] == pytest.approx(summary["epsilon"], abs=1e-3)


def test_atomic_save_never_leaves_a_partial_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "ckpt-00000001.pt"
    atomic_save({"x": torch.ones(3)}, target)

    def boom(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt  # e.g. killed while writing

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"x": torch.zeros(3)}, target)
    assert torch.equal(load_state(target)["x"], torch.ones(3))  # the old complete file survives
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # and the temp file is gone
    assert list_checkpoints(tmp_path) == [(1, target)]


def test_train_hf_config(tmp_path, capsys):
    """An HF config trains; past its max_position_embeddings (RoPE: computed positions) with a warning."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    cfg.to_json_file(tmp_path / "llama.json")
    assert cli.main(["train", "--hf-config", str(tmp_path / "llama.json"), "--steps", "2", "-T", "32", "--save-every",
                     "0", *FAST, "--accountant", "rdp", "--sigma", "1", "--out", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "HF LlamaForCausalLM" in out and len(metric_rows(tmp_path / "hf")) == 2
    assert 0 < reported_epsilon(out)[0] < float("inf")
    assert "WARNING: --seq-len 32 is longer than the model's max_position_embeddings = 16" in out


def test_learned_positions_shorter_than_the_sequence_are_refused_before_any_output(tmp_path, capsys):
    """GPT-2's position table has n_positions rows: T beyond it is a one-line usage error, and the
    run writes nothing (it used to die in an IndexError mid-step, leaving a half-made --out)."""
    import transformers
    transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=4, n_positions=16).to_json_file(tmp_path / "g.json")
    code = cli.main(["train", "--hf-config", str(tmp_path / "g.json"), "--steps", "1", "-T", "32", *FAST,
                     "--out", str(tmp_path / "gpt2")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--seq-len 32 is longer than the model's 16 learned positions (transformer.wpe)" in err[0]
    assert not (tmp_path / "gpt2" / "metrics.jsonl").exists()


@pytest.mark.parametrize("flags, words", [
    (["--delta", "0.5", "--steps", "2"], "--delta 0.5: delta=0.5 is >= "),
    (["--target-epsilon", "1e-3", "--steps", "100000", "--sample-rate", "0.5"], "is unreachable with noise_multiplier"),
])
def test_privacy_flags_that_cannot_be_met_are_one_line_usage_errors(tmp_path, capsys, flags, words):
    code = cli.main(["train", "-T", "32", "--max-files", "60", "--physical-batch-size", "4", *flags,
                     "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0] and "Error" not in err[0], err


def test_noise_that_swamps_the_gradient_is_announced(tmp_path, capsys):
    assert cli.main(["train", "--steps", "1", "-T", "32", "--save-every", "0", *FAST, "--target-epsilon", "1e-9",
                     "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "WARNING: σ = " in out and "the model will learn little or nothing" in out
    wrote = next(line for line in out.splitlines() if line.startswith("wrote "))
    for name in ("metrics.jsonl", "privacy.json", "loss_vs_epsilon.png", "final_model.pt", "summary.json",
                 "signature.json"):
        assert name in wrote and (tmp_path / "run" / name).exists(), name


@pytest.mark.slow
def test_torchrun_packed_documents_over_dp_cp_and_fsdp_train_as_one_process(tmp_path, capsys):
    """`train --model DIR --data PATH` packs under torchrun (a Hugging Face Llama saved with
    save_pretrained, its own BPE tokenizer): dp = 2 (each rank runs every other physical batch of
    the same logical batch, the short rank a batch of padding, the clipped sums meet in finalize),
    cp = 2 (every physical batch split along the sequence, documents attending within themselves
    around the ring) and dp = 2 x cp = 2 with ZeRO-3 over both. Same key, same draws: the same ε
    (printed by rank 0 only) and batch sizes as one process; dp and cp the same model (to float summation order); ZeRO-3
    draws its noise per shard, so its first step's loss is the one process's and its model
    reloads whole with from_pretrained."""
    import transformers

    from finetune_fixtures import documents, save, tiny_llama, tokenizer, write_folder

    texts = documents(40, seed=3)
    tok = tokenizer(texts)
    model = save(tiny_llama(len(tok)), tok, tmp_path / "model")
    docs = write_folder(tmp_path / "docs", texts)
    args = ["train", "--model", model, "--data", docs, "--steps", 3, "-T", 64, "--max-rows", 4, "--physical-batch-size", 1,
            "--expected-batch-size", 8, "--save-every", 0, "--insecure-seed", 3, "--log-private-stats",
            "--accountant", "rdp", "--sigma", 1]
    assert cli.main([str(a) for a in args] + ["--out", str(tmp_path / "one")]) == 0
    one = capsys.readouterr().out
    # 16 slots per row at T = 64, at most 2·E + 8 = 24 in all
    packed = "packed into physical batches of 4 rows x 64 (a logical batch's last ones of 2 rows) holding up to 24 units"
    assert packed in one
    a = metric_rows(tmp_path / "one")
    sizes = [r["not_covered_by_dp"]["logical_batch_size"] for r in a]
    assert sum(sizes) > 0
    padding = {}
    for run, ranks, flags, world in (("dp", 2, [], "cp=1, dp=2"), ("cp", 2, ["--cp", 2], "cp=2, dp=1"),
                                     ("fsdp", 4, ["--cp", 2, "--fsdp", "dp,cp"], "cp=2, dp=2")):
        out = run_cli(*args, *flags, "--out", run, cwd=tmp_path, timeout=600, launcher=[
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "-m", "longshield_fx"])
        assert out.returncode == 0, (run, log_excerpt(out.stderr))
        assert world in out.stdout and "not packed" not in out.stdout and packed in out.stdout, run
        assert reported_epsilon(out.stdout) == reported_epsilon(one), run
        assert out.stdout.count("privacy: ε =") == 1, run  # only rank 0 prints
        b = metric_rows(tmp_path / run)
        assert [r["not_covered_by_dp"]["logical_batch_size"] for r in b] == sizes, run
        padding[run] = json.loads((tmp_path / run / "summary.json").read_text())["not_covered_by_dp"]["packing"][
            "padding_fraction"]
        final = load_state(tmp_path / run / "final_model.pt")
        if run == "fsdp":
            assert train_losses(b)[0] == pytest.approx(train_losses(a)[0], rel=1e-5)
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / run / "model")
            whole = {f"lm.{k}": v for k, v in reloaded.state_dict().items()}
            assert all(torch.equal(whole[k], v) for k, v in final.items())  # whole tensors, every parameter
            continue
        assert train_losses(b) == pytest.approx(train_losses(a), rel=1e-5), run
        torch.testing.assert_close(final, load_state(tmp_path / "one" / "final_model.pt"), atol=1e-5, rtol=1e-4)
    one_padding = json.loads((tmp_path / "one" / "summary.json").read_text())["not_covered_by_dp"]["packing"][
        "padding_fraction"]
    assert padding["cp"] == one_padding  # the same physical batches, each cut in two
    assert padding["dp"] > one_padding  # an odd number of physical batches: the short rank ran one of padding


@pytest.mark.slow
def test_torchrun_restarts_a_run_whose_rank_died_from_its_newest_complete_checkpoint(tmp_path):
    """torchrun --max-restarts 1 relaunches the command as typed; it continues its own --out from
    step 4 (the step-6 checkpoint was cut by the kill and is never loaded), accounts steps 5-8
    once (ε is the uninterrupted 8 steps'), and ends where a resume by hand from step 4 ends.
    --insecure-seed (tests only) makes the two continuations' fresh noise keys the same."""
    from longshield_fx.runtime.accounting import epsilon_for

    (tmp_path / "restarted.py").write_text(KILLED_WHILE_SAVING)  # rank 0 dies half-way through ckpt-6
    args = ["train", "--steps", 8, "-T", 64, "--save-every", 2, "--keep-checkpoints", 10, *FAST, "--sigma", 1,
            "--accountant", "rdp", "--insecure-seed", 4, "--cp", 2]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    restarted = run_cli(*args, "--out", "run", cwd=tmp_path,
                        launcher=torchrun[:3] + ["--max-restarts", "1"] + torchrun[3:] + ["restarted.py", "6"])
    assert restarted.returncode == 0, log_excerpt(restarted.stderr)
    assert "ckpt-00000004.pt at step 4/8" in restarted.stdout, restarted.stdout
    rows = metric_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 9))  # the killed attempt's rows 5, 6 were redone once
    q = json.loads((tmp_path / "run" / "summary.json").read_text())["sample_rate"]
    assert rows[-1]["epsilon"] == pytest.approx(epsilon_for(1.0, q, 8, rows[-1]["delta"], "rdp"), rel=1e-9)
    by_hand = tmp_path / "by_hand"
    shutil.copytree(tmp_path / "run", by_hand)
    for step in (6, 8):
        (by_hand / "checkpoints" / f"ckpt-0000000{step}.pt").unlink()
    (by_hand / "final_model.pt").unlink()
    # by hand, a copy cut back to step 4 whose ledger holds steps 1-8: a fork (ε counts both branches)
    resumed = run_cli("train", "--resume", "by_hand", "--cp", 2, "--fork", cwd=tmp_path,
                      launcher=torchrun + ["-m", "longshield_fx"])
    assert resumed.returncode == 0, log_excerpt(resumed.stderr)
    final, again = load_state(tmp_path / "run" / "final_model.pt"), load_state(by_hand / "final_model.pt")
    for name in final:
        torch.testing.assert_close(again[name], final[name], rtol=0, atol=1e-6, msg=name)


def test_removing_one_long_document_moves_the_clipped_sum_by_at_most_c():
    """The document is the unit: a document longer than many T-byte chunks is one row, so
    adding or removing it changes the summed clipped gradient by at most C."""
    import longshield_fx as lf
    from oracles import logical, tiny_llama

    T, C = 64, 1.0
    corpus = stdlib_corpus(T, max_files=6)
    long_doc = max(range(corpus.num_documents), key=lambda i: corpus.lengths[i])
    assert corpus.lengths[long_doc] > 10 * T  # ten chunks' worth of bytes, one row
    assert corpus.ids.shape == (corpus.num_documents, T)
    sums = []
    for mask in (torch.ones(corpus.num_documents), torch.ones(corpus.num_documents).index_fill(0, torch.tensor([long_doc]), 0)):
        model = tiny_llama(seed=0)
        engine = lf.compile(model, config=lf.DPConfig(C, 0.0))
        engine.accumulate(corpus.ids, corpus.labels, mask=mask)
        engine.finalize(logical(int(mask.sum())))
        sums.append(torch.cat([p.grad.flatten().double() for p in model.parameters()]))
        if len(sums) == 1:
            assert engine.last_norms[long_doc] > C  # it is clipped: the bound is tight, not vacuous
    assert float((sums[0] - sums[1]).norm()) <= C * (1 + 1e-6)


@pytest.mark.slow
def test_torchrun_fsdp_checkpoint_saved_on_4_ranks_resumes_on_2(tmp_path):
    """--fsdp dp,cp on 4 ranks (dp=2 x cp=2, ZeRO-3) on the user's documents, evaluating a
    held-out split every step: the evaluation is the whole model's (the last one equals the
    written model's), and DCP checkpoints are written; with the last one removed (a run killed
    after step 2), the run resumes on 2 ranks (dp=2, ZeRO-3 over dp) and its step 3 starts
    from the same model: the same losses as the uninterrupted run's step 3. Steps 2 and 3 draw
    5 and 6 units, 3 physical batches of 2, which the two dp groups split unevenly: a run whose
    groups ran 2 and 1 of them hung in ZeRO-3's gathers (issue 35)."""
    import longshield_fx as lf
    from longshield_fx.cli.train_loop import evaluate
    from longshield_fx.documents import load_documents
    from longshield_fx.models import Llama

    from finetune_fixtures import documents, write_folder

    data = write_folder(tmp_path / "data", documents(40, seed=5))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    args = ["train", "--steps", 3, "-T", 64, "--save-every", 1, *FAST, "--expected-batch-size", 5,
            "--physical-batch-size", 2, "--insecure-seed", 3, "--accountant", "rdp", "--sigma", 0.5, "--data", data,
            "--max-rows", 2, "--eval-fraction", 0.25, "--eval-every", 1, "--log-private-stats", "--no-pack"]
    four = run_cli(*args, "--cp", 2, "--fsdp", "dp,cp", "--out", "run", cwd=tmp_path,
                   launcher=torchrun + ["4", "-m", "longshield_fx"], timeout=600)
    assert four.returncode == 0, log_excerpt(four.stderr)
    assert "cp=2, dp=2" in four.stdout
    sizes = [r["not_covered_by_dp"]["logical_batch_size"] for r in metric_rows(tmp_path / "run")]
    assert [math.ceil(size / 2) % 2 for size in sizes][1:] == [1, 1], sizes  # odd numbers of physical batches
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "ckpt-00000003.dcp" / ".metadata").is_file()
    assert load_state(checkpoints / "ckpt-00000003.pt")["dcp"] == "ckpt-00000003.dcp"
    final = load_state(tmp_path / "run" / "final_model.pt")  # gathered: whole tensors
    assert final["lm.tok_embeddings.weight"].shape == (256, 64)
    uninterrupted = metric_rows(tmp_path / "run")
    evals = [r["not_covered_by_dp"]["eval_loss"] for r in uninterrupted]
    assert len(evals) == 3 and len(set(evals)) == 3  # every step's own model
    held_out = load_documents(data, lambda text: list(text.encode("utf-8")), 64, 2, 0).split(0.25, 0)[1]

    def written_model_eval() -> float:
        model = lf.CausalLMLoss(Llama.from_name("tiny"))
        model.load_state_dict(load_state(tmp_path / "run" / "final_model.pt"))
        return evaluate(model, held_out, 4, "cpu")["eval_loss"]

    assert evals[-1] == pytest.approx(written_model_eval(), rel=1e-6)
    (checkpoints / "ckpt-00000003.pt").unlink()
    shutil.rmtree(checkpoints / "ckpt-00000003.dcp")
    _cut_ledger(tmp_path / "run", 2)
    two = run_cli("train", "--resume", "run", "--fsdp", "dp", cwd=tmp_path,
                  launcher=torchrun + ["2", "-m", "longshield_fx"], timeout=600)
    assert two.returncode == 0, log_excerpt(two.stderr)
    assert "resumed from" in two.stdout and "at step 2/3" in two.stdout and "cp=1, dp=2" in two.stdout
    resumed = metric_rows(tmp_path / "run")
    assert [r["epsilon"] for r in resumed] == [r["epsilon"] for r in uninterrupted]
    assert train_losses(resumed)[2] == pytest.approx(train_losses(uninterrupted)[2], rel=1e-5)
    # step 3's noise differs after re-sharding (no shard repeats a draw), so its model does too
    assert resumed[2]["not_covered_by_dp"]["eval_loss"] == pytest.approx(written_model_eval(), rel=1e-6)


def test_a_hold_out_that_leaves_too_few_units_is_named(tmp_path, capsys):
    data = tmp_path / "docs"
    data.mkdir()
    for i in range(6):
        (data / f"d{i}.txt").write_text(f"document number {i} with some text\n")
    code = cli.main(["train", "--model", "tiny", "-T", "32", "--data", str(data), "--eval-fraction", "0.9",
                     "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "N = 1 left for training after --eval-fraction 0.9 held out 5; lower it or the held-out fraction" in err[0]


def test_the_held_out_loss_reads_only_the_rows_that_predict_a_token(tmp_path):
    """Held-out units of several rows, some rows all padding: the loss and its token count are
    those of each unit run alone with all its rows, however many units a call takes."""
    import longshield_fx as lf
    from longshield_fx.cli.train_loop import evaluate
    from longshield_fx.documents import load_documents
    from longshield_fx.models import Llama

    from finetune_fixtures import documents, write_folder

    held_out = load_documents(write_folder(tmp_path / "data", documents(6, seed=2)),
                              lambda text: list(text.encode("utf-8")), 64, 12, 0)
    padding = (held_out.labels[..., 1:] == -100).all(-1)
    assert bool(padding.any()) and not bool(padding.all(-1).any())  # rows of padding, no unit without text
    torch.manual_seed(0)
    model = lf.CausalLMLoss(Llama.from_name("tiny"))
    with torch.no_grad():
        loss = sum(float(model(held_out.ids[u:u + 1], held_out.labels[u:u + 1]).double())
                   for u in range(held_out.num_units))
    tokens = int((held_out.labels[..., 1:] != -100).sum())
    for units_per_call in (1, 4):
        result = evaluate(model, held_out, units_per_call, "cpu")
        assert result["eval_tokens"] == tokens
        assert result["eval_loss"] == pytest.approx(loss / tokens, rel=1e-6)
    assert model.training


def test_durations_are_rounded_once():
    from longshield_fx.cli.train_report import _fmt_time

    assert [_fmt_time(s) for s in (59.94, 59.96, 119.96, 3601.0)] == ["59.9s", "1m00.0s", "2m00.0s", "60m01.0s"]
