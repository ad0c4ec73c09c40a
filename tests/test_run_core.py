"""``run_core``: one copy of a private run's book-keeping. Unit ids, and the run ledger through the
engine-loop helpers (a fresh engine loading from a run's folder), its ε checked against
dp-accounting's own PLD accountant."""
from __future__ import annotations

import json

import dp_accounting
import pytest
import torch

import longshield_fx as lf
from longshield_fx.data import PoissonBatches
from longshield_fx.run_core import LEDGER, RollbackRefused, RunLedger, canonical_unit_id
from oracles import MLP, mlp_batch

SIGMA, Q, DELTA = 0.8, 0.25, 1e-5


@pytest.mark.parametrize("variants", [
    ["alice", "Alice", "ALICE", " alice ", "alice\t", "ali\u200bce", "ａｌｉｃｅ", "ALI\u00adCE"],
    ["alice smith", "alice\u00a0smith", "alice  smith", "Alice\u2003Smith"],
    ["Jos\u00e9", "Jose\u0301", "JOS\u00c9"],
    [5, "5", " 5 ", "５"],
])
def test_every_spelling_of_one_id_is_one_unit(variants):
    assert len({canonical_unit_id(v) for v in variants}) == 1


def test_ids_that_differ_in_more_than_spelling_stay_apart():
    assert canonical_unit_id("5") != canonical_unit_id("05")
    assert canonical_unit_id("alice") != canonical_unit_id("a lice")
    with pytest.raises(TypeError):
        canonical_unit_id(True)


def _run(folder=None):
    """(engine, optimizer, sampler) over 40 examples of the MLP, q = Q."""
    torch.manual_seed(0)
    model = MLP()
    engine = lf.compile(model, config=lf.DPConfig(1.0, SIGMA, insecure_seed=3))
    x, y = mlp_batch(B=40, seed=1)
    sampler = PoissonBatches(torch.utils.data.TensorDataset(x, y), Q, 8, insecure_seed=4, steps=100)
    return engine, torch.optim.SGD(model.parameters(), lr=0.1), sampler


def _steps(engine, opt, sampler, n):
    draws = iter(sampler)
    for _ in range(n):
        batch = next(draws)
        for (x, y), mask in batch.physical:
            engine.accumulate(x, y, mask=mask)
        engine.finalize(batch)
        opt.step()
        opt.zero_grad()


def _pld(*steps):
    """ε at DELTA of (σ, count) Poisson-sampled Gaussian steps at Q, by dp-accounting's PLD accountant."""
    accountant = dp_accounting.pld.PLDAccountant()
    for sigma, count in steps:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(sigma)), count)
    return accountant.get_epsilon(DELTA)


def test_a_fresh_engine_refuses_an_older_checkpoint_of_the_runs_folder_and_a_fork_counts_both_branches(tmp_path):
    run = tmp_path / "run"
    engine, opt, sampler = _run()
    _steps(engine, opt, sampler, 2)
    lf.save_checkpoint(run / "step-2", engine, opt, sampler, run_dir=run)
    _steps(engine, opt, sampler, 2)
    lf.save_checkpoint(run / "step-4", engine, opt, sampler, run_dir=run)
    ledger = [json.loads(line) for line in (run / LEDGER).read_text().splitlines()]
    assert [r["step"] for r in ledger] == [1, 2, 3, 4] and all("key" not in json.dumps(r) for r in ledger)

    fresh, opt2, sampler2 = _run()
    before = [p.detach().clone() for p in fresh.model.parameters()]
    with pytest.raises(RollbackRefused, match="records step 4, released, and this state is at step 2"):
        lf.load_checkpoint(run / "step-2", fresh, opt2, sampler2, run_dir=run)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.model.parameters()))  # nothing changed
    assert fresh.accountant.steps == 0 and sampler2.step == 0

    with pytest.raises(ValueError, match="run_dir=None; pass the run's folder"):  # nothing to check it against
        lf.load_checkpoint(run / "step-2", fresh, opt2, sampler2, run_dir=None)
    lf.load_checkpoint(run / "step-2", fresh, opt2, sampler2, run_dir=run, fork=True)
    assert fresh.epsilon(DELTA) == pytest.approx(_pld((SIGMA, 4)), rel=1e-6)  # both released branches' steps
    _steps(fresh, opt2, sampler2, 3)  # steps 3 and 4 again (the same batches), then 5
    assert fresh.epsilon(DELTA) == pytest.approx(_pld((SIGMA, 3), (SIGMA / 2 ** 0.5, 2)), rel=1e-6)
    lf.save_checkpoint(run / "step-5", fresh, opt2, sampler2, run_dir=run)
    assert len((run / LEDGER).read_text().splitlines()) == 7

    # The same history through the ledger: the newest checkpoint loads without a fork, with ε intact.
    again, opt3, sampler3 = _run()
    lf.load_checkpoint(run / "step-5", again, opt3, sampler3, run_dir=run)
    assert again.epsilon(DELTA) == pytest.approx(fresh.epsilon(DELTA), rel=1e-9)


def test_a_fresh_start_in_a_folder_whose_ledger_holds_steps_is_a_fork_of_independent_draws(tmp_path):
    engine, opt, sampler = _run()
    _steps(engine, opt, sampler, 3)
    RunLedger(tmp_path).record(engine, sampler, "checkpoint")
    with pytest.raises(RollbackRefused, match="starting over, is at step 0"):
        RunLedger(tmp_path).admit(None, fork=False, fork_hint="fork", where="test")
    assert RunLedger(tmp_path).admit(None, fork=True, fork_hint="fork", where="test") == [(None, SIGMA, Q)] * 3


def test_a_resume_into_another_folder_keeps_both_folders_ledgers_whole(tmp_path):
    engine, opt, sampler = _run()
    _steps(engine, opt, sampler, 2)
    RunLedger(tmp_path / "a").record(engine, sampler)
    moved = RunLedger(tmp_path / "b", tmp_path / "a")
    assert moved.admit(engine.state_dict(sampler), fork=False, fork_hint="fork", where="test") == []
    _steps(engine, opt, sampler, 1)
    moved.record(engine, sampler)
    for folder in ("a", "b"):
        assert RunLedger(tmp_path / folder).newest() == 3


def test_a_ledger_that_lost_its_early_lines_still_counts_the_later_branch(tmp_path):
    """The ledger holds only steps 3-4 (its first lines lost, or written by a run that had none
    before): a fork from a state at step 2 still counts them, never fewer than the ledger shows."""
    engine, opt, sampler = _run()
    _steps(engine, opt, sampler, 2)
    state = engine.state_dict(sampler)
    _steps(engine, opt, sampler, 2)
    RunLedger(tmp_path).record(engine, sampler)
    ledger = tmp_path / LEDGER
    ledger.write_text("".join(line + "\n" for line in ledger.read_text().splitlines() if json.loads(line)["step"] > 2))
    elsewhere = RunLedger(tmp_path).admit(state, fork=True, fork_hint="fork", where="test")
    assert sorted(elsewhere) == [(3, SIGMA, Q), (4, SIGMA, Q)]


def test_a_line_cut_by_a_kill_loses_no_later_step(tmp_path):
    """A kill mid-append leaves a last line without its newline: the next record starts a line of
    its own, so the cut line is the only one lost (its step never left the process) and the newest
    released step still refuses an older state."""
    engine, opt, sampler = _run()
    _steps(engine, opt, sampler, 1)
    ledger = RunLedger(tmp_path)
    ledger.record(engine, sampler)
    with open(tmp_path / LEDGER, "a") as f:
        f.write('{"step": 2, "sigma": 0.8, "q"')
    _steps(engine, opt, sampler, 2)
    assert ledger.record(engine, sampler) == 2
    assert RunLedger(tmp_path).newest() == 3
    assert [r["step"] for r in RunLedger(tmp_path).records()] == [1, 2, 3]
    before = (tmp_path / LEDGER).read_text()
    RunLedger(tmp_path / "copy", tmp_path).sync()
    assert (tmp_path / "copy" / LEDGER).read_text().count("\n") == 3
    assert (tmp_path / LEDGER).read_text() == before  # the cut line hides none of the lines it holds
