"""The memory planner: the per-node affine fit, the CLI's errors, and the paper's ordering claim.

Graph captures are memoised in-process (``longshield_fx.plan._MEMO``), so tests that need
the same (spec, T) share one capture. The slow tests capture the three real models (12
captures, minutes each for 8B on a busy 2-core CPU); with ``LONGSHIELD_FX_CACHE=DIR`` set
they also read and write the planner's disk cache there (entries are keyed by a hash of the
graph-building sources and the torch version, so a stale entry is never read).
"""
import dataclasses
import math
import os
from pathlib import Path

import pytest

from longshield_fx import plan as P

SMALL = dict(dtype="fp32")  # the byte-vocabulary "small" reference Llama: captures in seconds


@pytest.mark.parametrize("cp,checkpoint", [(1, None), (2, "block")], ids=["cp1", "cp2-block"])
def test_affine_fit_predicts_a_third_T(cp, checkpoint):
    """The fitted peak at a third T (4x the larger fit point) matches a direct capture there."""
    spec = P.GraphSpec("small", cp=cp, checkpoint=checkpoint, **SMALL)
    fit = P.fit_graph(spec)
    T3 = 4 * fit.T_points[1]
    direct = P.measure(spec, T3)
    predicted, node = fit.peak(T3)
    actual = max(direct.timeline) + direct.batch_bytes
    assert predicted == pytest.approx(actual, rel=0.02), (node, predicted, actual)


def test_uncheckpointed_graph_recorded_during_a_checkpointed_capture_is_the_plain_graph():
    spec = P.GraphSpec("small", cp=2, checkpoint="block", **SMALL)
    plain = dataclasses.replace(spec, checkpoint=None)
    T = P.fit_points(2)[0]
    P.measure(spec, T)
    recorded = P._MEMO.pop((plain, T))
    direct = P.measure(plain, T)
    assert recorded.ops_digest == direct.ops_digest
    assert recorded.timeline == direct.timeline


def test_memory_grows_with_T_and_shrinks_with_gpus():
    spec = P.GraphSpec("small", cp=1, **SMALL)
    fit = P.fit_graph(spec)
    stats = P.model_stats("small")
    lp = P.LayoutPlan("x", spec, fit, 4, 1 * P.GiB, 0.0, stats)
    assert lp.breakdown(4096).total > lp.breakdown(1024).total
    many = P.LayoutPlan("x", spec, fit, 64, 1 * P.GiB, 0.0, stats)
    assert many.breakdown(1024).optimizer * 16 == pytest.approx(lp.breakdown(1024).optimizer)
    solved = P.LayoutPlan("x", spec, fit, 4, 0.05 * P.GiB, 0.0, stats).solve()
    assert solved.max_T is not None and solved.at_max.total <= 0.05 * P.GiB
    assert solved.breakdown(2 * solved.max_T).total > 0.05 * P.GiB
    assert P.LayoutPlan("x", spec, fit, 4, 1e-6 * P.GiB, 0.0, stats).solve().max_T is None


def test_model_stats_match_llama_parameter_counts():
    assert P.model_stats("llama3.2-1b").params == pytest.approx(1.236e9, rel=0.01)
    assert P.model_stats("llama3.2-3b").params == pytest.approx(3.213e9, rel=0.01)
    eight = P.model_stats("llama3.1-8b")
    assert eight.params == pytest.approx(8.03e9, rel=0.01)
    # the largest FSDP units: the final norm + output head, then the (untied) embedding
    assert eight.units[:2] == (128256 * 4096 + 4096, 128256 * 4096)


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama-9000", "--gpus", "4", "--gpu-mem-gb", "80"], "invalid choice: 'llama-9000'"),
    (["--model", "llama3.2-1b", "--gpus", "0", "--gpu-mem-gb", "80"], "--gpus: must be > 0"),
    (["--model", "llama3.2-1b", "--gpus", "-4", "--gpu-mem-gb", "80"], "--gpus: must be > 0"),
    (["--model", "llama3.2-1b", "--gpus", "4", "--gpu-mem-gb", "0"], "--gpu-mem-gb: must be > 0"),
    (["--model", "llama3.2-1b", "--gpus", "4", "--gpu-mem-gb", "-80"], "--gpu-mem-gb: must be > 0"),
    (["--model", "llama3.2-1b", "--gpus", "4", "--gpu-mem-gb", "80", "--cp", "3"], "--cp 3 does not divide --gpus 4"),
    (["--model", "llama3.2-1b", "--gpus", "6", "--gpu-mem-gb", "80", "--cp", "4"], "--cp 4 does not divide --gpus 6"),
    (["--gpus", "4", "--gpu-mem-gb", "80"], "required: --model"),
    (["--model", "llama3.2-1b", "--gpus", "four", "--gpu-mem-gb", "80"], "--gpus: not a number"),
])
def test_bad_requests_exit_nonzero_with_one_line(argv, message, capsys):
    assert P.main(argv) != 0
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


# --- the paper's ordering claim, real shapes -----------------------------------------------------------

@pytest.fixture(scope="module")
def plans_4x80():
    """model -> (FSDP-style, DP cp=4, DP cp=4 + block) at 4 x 80 GiB, MBS 1, bf16."""
    out = {}
    cache = Path(os.environ["LONGSHIELD_FX_CACHE"]) if os.environ.get("LONGSHIELD_FX_CACHE") else None

    def get(model):
        if model not in out:
            # the checkpointed capture also records the cp=4 graph without checkpointing
            block, fsdp = P.plan(model, 4, 80.0, cp=4, checkpoint="block", cache_dir=cache)
            plain = P.plan_layout("DP cp=4", P.GraphSpec(model, 4, None, 1, "bf16"), gpus=4, gpu_mem_gib=80.0,
                                  cache_dir=cache)
            out[model] = fsdp, plain, block
        return out[model]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("model", P.MODELS)
def test_cp4_reaches_4x_the_fsdp_context_and_block_checkpointing_more(model, plans_4x80):
    fsdp, plain, block = plans_4x80(model)
    assert plain.max_T is not None, f"{model}: DP cp=4 fits no context at all"
    assert plain.max_T >= 4 * (fsdp.max_T or 0), (fsdp.max_T, plain.max_T)
    assert block.max_T is not None and block.max_T > plain.max_T, (plain.max_T, block.max_T)
    for lp in (fsdp, plain, block):
        if lp.max_T:
            assert lp.at_max.total <= 80 * P.GiB < lp.breakdown(2 * lp.max_T).total


@pytest.mark.slow
def test_main_prints_the_plan(plans_4x80, capsys):
    plans_4x80("llama3.2-1b")  # the captures main needs are memoised by now
    assert P.main(["--model", "llama3.2-1b", "--gpus", "4", "--gpu-mem-gb", "80", "--checkpoint", "block",
                   "--cache-dir", "", "--seq-len", "65536"]) == 0
    out = capsys.readouterr().out
    fsdp, _, block = plans_4x80("llama3.2-1b")
    assert "DP cp=4 block" in out and "FSDP-style cp=1" in out
    for lp in (block, fsdp):
        assert P._tokens(lp.max_T) in out
    for column in ("params", "grads", "optimizer", "gathered", "graph", "overhead", "total"):
        assert column in out
    assert "at T = 65536" in out
    assert math.isfinite(block.at_max.total)
