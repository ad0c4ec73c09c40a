"""``longshield-fx audit``: train's job run once with canaries, the claimed ε beside the bound.

- a white-box and a black-box audit of a short job print the claimed ε and the empirical lower
  bound side by side, and write them (audit.json) with the score histogram (PNG); the claimed ε
  is the run's own (the accountant's at the job's δ); no model and no checkpoint are written;
- ``train`` is untouched by the audit: it never imports the audit library, and a seeded train
  run gives the same parameters bit for bit before and after an audit in the same process;
- bad flags give one line and exit status 2.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli_runs import FAST, assert_bit_identical, env, load_state, metric_rows
from longshield_fx import cli

# A short job: 3 steps at T = 32 over 60 documents, σ given (no calibration), RDP (fast).
JOB = ["--steps", 3, "-T", 32, *FAST, "--sigma", 1.0, "--accountant", "rdp", "--insecure-seed", 3]


def _main(argv, capsys) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """train, a white-box audit, then train again: same seeds, same process."""
    root = tmp_path_factory.mktemp("audit")
    train = ["train", *JOB, "--save-every", 0]
    for name, argv in (("train_before", train), ("white", ["audit", *JOB, "--canaries", 400]), ("train_after", train)):
        assert cli.main([str(a) for a in argv] + ["--out", str(root / name)]) == 0, name
    return root


def _check_outputs(run, kind, m):
    report = json.loads((run / "audit.json").read_text())
    assert report["kind"] == kind and report["canaries"] == m
    assert report["claimed_epsilon"] == pytest.approx(metric_rows(run)[-1]["epsilon"])  # the run's own ε
    assert report["delta"] == metric_rows(run)[-1]["delta"] and report["confidence"] == 0.95
    assert 0 <= report["epsilon_lower_bound"] <= report["claimed_epsilon"]
    assert 0 < report["canaries_included"] < report["canaries"] and report["candidates"] == 14
    assert report["correct"] <= report["guesses"] == report["k_plus"] + report["k_minus"]
    png = (run / "audit_scores.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    assert not (run / "final_model.pt").exists() and not (run / "checkpoints").exists()
    return report


@pytest.mark.slow
def test_white_box_audit_writes_the_claim_beside_the_bound_and_the_histogram(runs):
    _check_outputs(runs / "white", "white", 400)


def test_black_box_audit_prints_the_claim_and_the_bound_on_one_line(tmp_path, capsys):
    code, out, _ = _main(["audit", *JOB, "--steps", 2, "--kind", "black", "--canaries", 100, "--out", tmp_path / "b"],
                         capsys)
    assert code == 0
    report = _check_outputs(tmp_path / "b", "black", 100)
    line = next(ln for ln in out.splitlines() if ln.startswith("audit: claimed ε = "))
    assert f"claimed ε = {report['claimed_epsilon']:.3f}, empirical lower bound ε >= " \
           f"{report['epsilon_lower_bound']:.3f} at 95% confidence" in line
    assert "VOID: --insecure-seed 3" in out  # the test seed is loud here too


@pytest.mark.slow
def test_train_is_bitwise_unaffected_by_an_audit(runs):
    before, after = (load_state(runs / k / "final_model.pt") for k in ("train_before", "train_after"))
    assert_bit_identical(before, after)
    assert not (runs / "train_before" / "audit.json").exists()
    assert all(name.startswith("lm.") for name in before)  # no audit parameter in train's model


def test_train_never_loads_the_audit_library_nor_what_only_some_ranks_and_runs_need():
    """Every rank of every run imports the CLI: the audit, and the libraries only a sharded run
    (DTensor, DCP) or the rank that reports epsilon (dp_accounting, with scipy) uses, are
    imported where used (1.8 s of each process's start otherwise)."""
    later = ("longshield_fx.audit", "dp_accounting", "scipy", "torch.distributed.tensor",
             "torch.distributed.checkpoint", "networkx")
    code = ("import sys; from longshield_fx import cli; import longshield_fx.cli.train; cli.build_parser(); "
            f"print(sorted({{'.'.join(m.split('.')[:3 if m.startswith('torch') else 1]) for m in sys.modules "
            f"if m.startswith({later!r})}}))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def test_more_canaries_than_memory_holds_are_refused_in_one_line_before_anything_is_built(tmp_path, capsys,
                                                                                          monkeypatch):
    """A billion canaries of 2048 tokens (terabytes) are refused before the corpus, the canaries
    and the model, instead of the process being killed for memory; nothing is written."""
    from longshield_fx.cli import audit

    def built(*_):
        raise AssertionError("the corpus was loaded before the canary count was refused")

    monkeypatch.setattr(audit, "load_corpus", built)
    out = tmp_path / "big"
    code, _, err = _main(["audit", *JOB, "-T", 2048, "--canaries", 1000000000, "--out", out], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--canaries 1000000000" in err and " bytes" in err and "available" in err, err
    assert "use a smaller --canaries" in err, err
    assert not out.exists() or not any(out.iterdir())


def test_the_canary_memory_estimate_accepts_the_default_count():
    from longshield_fx.cli import audit

    gib = 2 ** 30
    for kind in ("white", "black"):
        audit._check_canary_memory(1000, kind, 2048, available=gib)  # the default m, a long T: tens of MiB
        audit._check_canary_memory(1000, kind, 2048)  # and on this machine
    # At least the rows themselves: ~m/2 included canaries of int64 ids and labels (white), the
    # (m, T) int64 sequences and their included rows (black).
    assert audit._canary_bytes(1000, "white", 2048) >= 500 * 2048 * 16
    assert audit._canary_bytes(1000, "black", 2048) >= 1000 * 2048 * 8 + 500 * 2048 * 16
    with pytest.raises(cli.CLIError, match=r"--canaries 1000000: .* use a smaller --canaries \(at most [\d,]+ here\)"):
        audit._check_canary_memory(10 ** 6, "black", 2048, available=gib)
