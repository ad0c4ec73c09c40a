"""The command-line interface: ``longshield-fx train`` / ``inspect`` and ``python -m longshield_fx``.

- a short training run writes metrics, the loss-vs-ε plot and a summary, and reports ε <= target;
- checkpoints: SIGKILL mid-run then ``--resume`` gives bit-identical final parameters; temp and
  damaged files are never loaded; a checkpoint of a different run is refused by name;
- ``inspect`` of the tiny model is pinned (passes, node counts, rules); the SVG is written;
  with ``--cp 2`` outside torchrun it runs on a fake process group and lists the collectives;
- bad flags give one line on stderr, no traceback, a non-zero exit;
- under torchrun, ``--cp 2`` trains and reports the same ε as one process.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from expecttest import assert_expected_inline

from longshield_fx import cli

REPO = Path(__file__).resolve().parents[1]
# Small corpus and sequences: a step of the tiny model takes well under a second.
FAST = ["--max-files", "60", "--expected-batch-size", "6", "--physical-batch-size", "4"]
SHORT = ["train", "--steps", 12, "-T", 128, "--save-every", 2, *FAST]


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("LONGSHIELD_FX_DEBUG", None)
    # One thread per process: the shapes are tiny, and spinning OpenMP threads make the runs
    # much slower when the machine is shared (and torchrun sets the same).
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_cli(*args, cwd, timeout=300, launcher=None):
    cmd = (launcher or [sys.executable, "-m", "longshield_fx"]) + [str(a) for a in args]
    env = _env()
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def reported_epsilon(stdout: str) -> tuple[float, str]:
    m = re.search(r"privacy: ε = ([0-9.]+)(.*)", stdout)
    assert m, stdout
    return float(m.group(1)), m.group(2)


def load_state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_bit_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k, x in a.items():
        assert x.dtype == b[k].dtype and torch.equal(x, b[k]), k


def metric_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# --- train ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """12 steps at T=128 with a checkpoint every 2 steps (the newest 2 are kept)."""
    root = tmp_path_factory.mktemp("short")
    res = run_cli(*SHORT, "--out", "run", cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    return root / "run", res


def test_train_writes_metrics_plot_and_epsilon_within_target(short_run):
    run, res = short_run
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(r["loss"] is None or 0 < r["loss"] < 10 for r in rows)
    eps, rest = reported_epsilon(res.stdout)
    assert 0 < eps <= 8.0 and "<= target 8" in rest
    assert rows[-1]["epsilon"] == pytest.approx(eps, abs=1e-3)
    assert json.loads((run / "summary.json").read_text())["epsilon"] <= 8.0
    png = (run / "loss_vs_epsilon.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt-00000010.pt", "ckpt-00000012.pt"]
    assert (run / "final_model.pt").is_file()
    assert "loss/token:" in res.stdout and "train" in res.stderr  # summary and progress bar


def test_resume_ignores_temp_and_damaged_checkpoints_and_is_bit_identical(short_run, tmp_path):
    run, _ = short_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ckpts = copy / "checkpoints"
    good = (ckpts / "ckpt-00000010.pt").read_bytes()
    # A writer killed mid-save leaves its temp file (never named ckpt-*.pt) ...
    (ckpts / ".ckpt-00000014.pt.tmp-4242").write_bytes(good[: len(good) // 2])
    # ... and a damaged file under a complete name is skipped for an older one.
    last = ckpts / "ckpt-00000012.pt"
    last.write_bytes(last.read_bytes()[:1000])
    (copy / "final_model.pt").unlink()

    res = run_cli(*SHORT, "--resume", copy, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and "ckpt-00000010.pt at step 10/12" in res.stdout
    assert "skipped unreadable checkpoint(s) ckpt-00000012.pt" in res.stdout + res.stderr
    assert_bit_identical(load_state(run / "final_model.pt"), load_state(copy / "final_model.pt"))
    before, after = metric_rows(run), metric_rows(copy)
    assert [(r["step"], r["loss"], r["epsilon"]) for r in before] == [(r["step"], r["loss"], r["epsilon"]) for r in after]


@pytest.mark.parametrize("change, named", [
    (["-T", "256"], "seq_len: 128 in the checkpoint, 256 now"),
    (["-T", "128", "--clipping", "per_layer"], "dp.clipping: 'flat' in the checkpoint, 'per_layer' now"),
    (["-T", "128", "--model", "small"], "model.dim: 64 in the checkpoint, 256 now"),
])
def test_resume_refuses_checkpoint_of_a_different_run(short_run, tmp_path, capsys, change, named):
    run, _ = short_run
    code = cli.main(["train", "--steps", "12", "--save-every", "2", *FAST, *change, "--resume", str(run),
                     "--out", str(tmp_path / "other")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "refusing to resume" in err and named in err, err


@pytest.mark.slow
def test_sigkill_then_resume_reaches_bit_identical_parameters(short_run, tmp_path):
    full, full_res = short_run  # the uninterrupted run
    proc = subprocess.Popen([sys.executable, "-m", "longshield_fx", *map(str, SHORT), "--out", "killed"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    ckpts = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 240
    try:
        while not (ckpts.is_dir() and any(p.name.startswith("ckpt-") for p in ckpts.iterdir())):
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.time() < deadline, "no checkpoint after 240 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "final_model.pt").exists()  # killed mid-way

    res = run_cli(*SHORT, "--resume", "killed", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    step = int(re.search(r"at step (\d+)/12", res.stdout).group(1))
    assert 0 < step < 12
    assert_bit_identical(load_state(full / "final_model.pt"), load_state(tmp_path / "killed" / "final_model.pt"))
    assert [r["loss"] for r in metric_rows(full)] == [r["loss"] for r in metric_rows(tmp_path / "killed")]
    assert reported_epsilon(res.stdout)[0] == reported_epsilon(full_res.stdout)[0]


def test_atomic_save_never_leaves_a_partial_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "ckpt-00000001.pt"
    cli.atomic_save({"x": torch.ones(3)}, target)

    def boom(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt  # e.g. killed while writing

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        cli.atomic_save({"x": torch.zeros(3)}, target)
    assert torch.equal(load_state(target)["x"], torch.ones(3))  # the old complete file survives
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # and the temp file is gone
    assert cli.list_checkpoints(tmp_path) == [(1, target)]


@pytest.mark.slow
def test_train_hf_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg.to_json_file(tmp_path / "llama.json")
    res = run_cli("train", "--hf-config", "llama.json", "--steps", 2, "-T", 32, "--save-every", 0, *FAST,
                  "--out", "hf", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "HF LlamaForCausalLM" in res.stdout and len(metric_rows(tmp_path / "hf")) == 2
    assert reported_epsilon(res.stdout)[0] <= 8.0


@pytest.mark.slow
def test_torchrun_cp2_reports_the_same_epsilon_as_one_process(tmp_path):
    args = ["train", "--steps", 5, "-T", 64, "--save-every", 0, *FAST]
    one = run_cli(*args, "--out", "cp1", cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli(*args, "--cp", 2, "--out", "cp2", cwd=tmp_path, launcher=[
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "longshield_fx"])
    assert two.returncode == 0, two.stderr[-3000:]
    assert "cp=2, dp=1" in two.stdout
    assert two.stdout.count("privacy: ε =") == 1  # only rank 0 prints
    assert reported_epsilon(two.stdout) == reported_epsilon(one.stdout)
    a, b = metric_rows(tmp_path / "cp1"), metric_rows(tmp_path / "cp2")
    assert [r["epsilon"] for r in a] == [r["epsilon"] for r in b]
    assert [r["batch_size"] for r in a] == [r["batch_size"] for r in b]  # same Poisson draws
    # Same job: the first step's loss (same initial model, same batch) agrees to float tolerance.
    first = next(i for i, r in enumerate(a) if r["loss"] is not None)
    assert b[first]["loss"] == pytest.approx(a[first]["loss"], rel=1e-5)


# --- inspect --------------------------------------------------------------------------------

def _normalize_inspect(text: str) -> str:
    """Pass names with node counts, and the per-sample rule summary."""
    keep, section = [], None
    for line in text.splitlines():
        if line.startswith(("passes", "per-sample rules", "per parameter", "collectives")):
            section = line.split()[0]
            continue
        if section == "passes" and re.match(r"  \S+ +\d+ -> +\d+$", line):
            name, before, _, after = line.split()
            keep.append(f"{name}: {before} -> {after}")
        elif section == "per-sample" and line.startswith("  "):
            keep.append(line.strip())
    return "\n".join(keep) + "\n"


def test_inspect_tiny_is_pinned_and_writes_svg(tmp_path, capsys):
    assert cli.main(["inspect", "-T", "64", "--out", str(tmp_path), "--svg-backend", "builtin"]) == 0
    out = capsys.readouterr().out
    assert_expected_inline(_normalize_inspect(out), """\
batch_dims: 538 -> 538
per_sample: 538 -> 503
clip: 503 -> 678
embedding x1: lm.tok_embeddings.weight
linear x15: lm.layers.*.attention.wq.weight, lm.layers.*.attention.wk.weight, lm.layers.*.attention.wv.weight, lm.layers.*.attention.wo.weight, lm.layers.*.feed_forward.w1.weight, lm.layers.*.feed_forward.w2.weight, lm.layers.*.feed_forward.w3.weight, lm.lm_head.weight
sum x5: lm.layers.*.attention_norm.weight, lm.layers.*.ffn_norm.weight, lm.norm.weight
""")
    assert "none (cp=1" in out
    svg = tmp_path / "block_layers.0.svg"
    text = svg.read_text()
    assert text.startswith("<svg") and text.rstrip().endswith("</svg>") and text.count("<rect") > 50
    assert "einsum" in text  # the block's per-sample gradients, inserted by a pass, are drawn
    assert (tmp_path / "training_graph.py").stat().st_size > 0


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_inspect_graphviz_svg(tmp_path, capsys):
    assert cli.main(["inspect", "-T", "32", "--out", str(tmp_path), "--svg-backend", "graphviz",
                     "--checkpoint", "block"]) == 0
    assert "(graphviz," in capsys.readouterr().out
    text = (tmp_path / "block_layers.0.svg").read_text()
    assert "<svg" in text and "einsum" in text


def test_inspect_cp2_on_a_fake_process_group_lists_collectives(tmp_path):
    res = run_cli("inspect", "--cp", 2, "-T", 64, "--out", "insp", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "cp=2 (fake process group, one process)" in out
    assert re.search(r"context_parallel +\d+ -> +\d+", out) and re.search(r"shard_grads +\d+ -> +\d+", out)
    totals = {k: int(v.replace(",", "")) for k, v in re.findall(r"(\w+) ([\d,]+) B \(", out)}
    per_node: dict[str, int] = {}
    for op, nbytes in re.findall(r"^  \S+ +(\w+) +\S+ +([\d,]+) B$", out, flags=re.MULTILINE):
        kind = next(k for k in totals if op.startswith(k))
        per_node[kind] = per_node.get(kind, 0) + int(nbytes.replace(",", ""))
    assert totals["reduce_scatter"] > 0 and totals["ring_attention"] > 0
    assert per_node == {k: v for k, v in totals.items() if v}  # the list adds up to communication_bytes()
    assert (tmp_path / "insp" / "block_layers.0.svg").stat().st_size > 0


# --- flags, help, entry points --------------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["train", "--steps", "-3"], "--steps: must be > 0"),
    (["train", "--steps", "0"], "--steps: must be > 0"),
    (["train", "-T", "100", "--cp", "3"], "not a multiple of 2*cp = 6"),
    (["inspect", "-T", "30", "--cp", "2"], "not a multiple of 2*cp = 4"),
    (["train", "--clipping", "bogus"], "invalid choice: 'bogus'"),
    (["train", "--checkpoint", "everything"], "invalid choice: 'everything'"),
    (["train", "--hf-config", "no/such/config.json"], "--hf-config: no such file"),
    (["train", "--model", "huge"], "invalid choice: 'huge'"),
    (["train", "--cp", "2", "-T", "64"], "needs 2 processes: torchrun"),
    (["train", "--resume", "no/such/run"], "--resume: no such directory"),
    (["train", "--sigma", "-1"], "--sigma: must be >= 0"),
    (["train", "--sigma", "1", "--target-epsilon", "3"], "not allowed with argument"),
    (["train", "-T", "1"], "--seq-len must be >= 2"),
])
def test_bad_flags_exit_nonzero_with_one_line(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code not in (0, None)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert says in err and err.startswith("longshield-fx"), err
    assert not (tmp_path / "runs").exists()  # nothing written


def test_hf_config_without_transformers_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "llama.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    assert cli.main(["train", "--hf-config", str(tmp_path / "llama.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "longshield-fx train: error: --hf-config needs the transformers package: pip install transformers"


def test_bad_flags_from_the_console_script_and_python_m(tmp_path):
    script = Path(sys.executable).with_name("longshield-fx")
    cases = [([sys.executable, "-m", "longshield_fx"], ["train", "-T", "30", "--cp", "2"])]
    if script.exists():
        cases.append(([str(script)], ["train", "--steps", "-1"]))
    for launcher, argv in cases:
        res = run_cli(*argv, cwd=tmp_path, launcher=launcher)
        assert res.returncode == 2 and res.stdout == ""
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.startswith("longshield-fx train: error: ")


def test_every_flag_of_every_subcommand_documents_its_default(capsys):
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0])))
    assert set(subparsers.choices) == {"train", "inspect", "plan"}
    from longshield_fx import plan

    for name, sub in subparsers.choices.items():
        if name == "plan":  # dispatched to its own parser
            sub = plan.build_parser()
        formatter = sub._get_formatter()
        for action in sub._actions:
            if action.dest == "help":
                continue
            text = formatter._get_help_string(action)
            assert text and len(text) > 15, (name, action.dest)
            assert "default" in text, (name, action.dest)
        try:
            code = cli.main([name, "--help"])
        except SystemExit as e:
            code = e.code
        assert code == 0
        assert "(default: " in capsys.readouterr().out


def test_python_m_is_the_console_script(tmp_path):
    res = run_cli("--help", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("usage: longshield-fx [-h] {train,inspect,plan}")
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0


def test_inspect_memory_and_timeline(tmp_path, capsys):
    assert cli.main(["inspect", "-T", "32", "--out", str(tmp_path), "--svg-backend", "builtin",
                     "--memory", "--timeline", "CPU-gloo"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"peak [\d.]+ MiB of intermediates at \w+", out)
    assert "largest tensors live at the peak" in out
    assert "timeline (CPU-gloo, cost model)" in out
    assert (tmp_path / "timeline.png").stat().st_size > 0
