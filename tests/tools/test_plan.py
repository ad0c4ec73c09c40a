"""The memory planner: the per-node affine fit, one capture serving two layouts, the CLI's
errors, and the paper's ordering claim at the paper's real shapes.

Captures are the cost here (seconds for the byte-vocabulary "small" Llama, up to a minute for
8B at cp=4), so each module fixture asks ``plan_graphs.prefetch`` for every capture its tests
read, once, two worker processes at a time (the captures are single-threaded Python; this
machine has 2 cores), and the tests read them from the in-process memo. With
``LONGSHIELD_FX_CACHE=DIR`` set the paper-shape captures also go through the planner's disk
cache there (keyed by a hash of the graph-building sources and the torch version, so a stale
entry is never read).
"""
import math
import os
from pathlib import Path

import pytest

from longshield_fx import cli
from longshield_fx.tools import plan as P
from longshield_fx.tools import plan_graphs
from longshield_fx.tools.paper_tables import ModelPlans, summary_row

JOBS = 2
SMALL = [P.GraphSpec("small", 1, None, 1, "fp32"), P.GraphSpec("small", 2, "block", 1, "fp32")]
TWENTY = P.GraphSpec("small", 2, "block", 1, "fp32", overrides=(("n_layers", 20),))  # fitted from 4, 5 and 6 layers


def third_T(spec) -> int:
    return 4 * P.fit_points(spec.cp)[1]


PAPER = [P.GraphSpec(m, 4, "block", 1, "bf16") for m in P.MODELS] + [P.GraphSpec(m, 1, None, 1, "bf16")
                                                                       for m in P.MODELS]
# 2D attention planned end to end: llama3.2-1b on 4 GPUs as hp=2 x cp=2 (its FSDP-style layout is in PAPER).
HP2 = P.GraphSpec("llama3.2-1b", 2, None, 1, "bf16", hp=2)


def _cache_dir() -> Path | None:
    return Path(os.environ["LONGSHIELD_FX_CACHE"]) if os.environ.get("LONGSHIELD_FX_CACHE") else None


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen2 config saved as a model folder and as a JSON file, and the spec the planner
    builds from it (as ``plan --model`` and ``--hf-config`` do: both read the same config)."""
    import transformers

    folder = tmp_path_factory.mktemp("qwen")
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    config.save_pretrained(folder / "model")
    config.to_json_file(folder / "config.json")
    config = transformers.AutoConfig.from_pretrained(folder / "model")
    return folder, config, P.GraphSpec(plan_graphs.hf_model(config), 1, None, 1, "bf16")


@pytest.fixture(scope="module")
def captures(qwen):
    """Every capture this module reads, made once by one pool of two worker processes, costliest
    first: the small model's at its two fit points and a third T (cp=1; cp=2 + block, which
    brings cp=2 without checkpointing along), its 20-layer variant at 4, 5 and 6 layers and whole
    at the third T, the paper models' at their fit points (cp=4 + block, bringing plain cp=4;
    FSDP-style cp=1; 3B's and 8B's at 4, 5 and 6 layers), llama3.2-1b at hp=2 x cp=2, and the
    tiny Qwen2's at its three fit points and a fourth T."""
    small = [(s, T) for s in SMALL for T in (*P.fit_points(s.cp), third_T(s))] + [(TWENTY, third_T(TWENTY))]
    hf = qwen[2]
    plan_graphs.prefetch(small + P.fit_requests([TWENTY] + PAPER + [HP2, hf]) + [(hf, third_T(hf))], _cache_dir(),
                         jobs=JOBS)


@pytest.fixture(scope="module")
def small_captures(captures):
    """The small model's captures, memoised in this process by ``captures``."""
    for spec, T in [(s, T) for s in SMALL for T in (*P.fit_points(s.cp), third_T(s))]:
        assert plan_graphs.cached(spec, T) is not None


@pytest.mark.parametrize("spec", SMALL, ids=["cp1", "cp2-block"])
def test_affine_fit_predicts_a_third_T(spec, small_captures):
    """The fitted peak at a third T (4x the larger fit point) matches a direct capture there."""
    fit = P.fit_graph(spec)
    T3 = third_T(spec)
    direct = P.measure(spec, T3)
    predicted, node = fit.peak(T3)
    actual = max(direct.timeline) + direct.batch_bytes
    assert predicted == pytest.approx(actual, rel=0.02), (node, predicted, actual)


def test_a_fit_extrapolated_in_layers_predicts_a_direct_capture_of_every_layer(small_captures):
    """A 20-layer Llama is fitted from its graphs at 4, 5 and 6 layers (``tools.plan_layers``),
    the checkpointed one and the plain one its capture brought along; at a third T both predict
    the peak of a direct capture of all 20 layers to the byte."""
    for spec in (TWENTY, TWENTY.plain):
        fit = P.fit_graph(spec)
        assert fit.layers == (4, 5, 6)
        T3 = third_T(spec)
        direct = P.measure(spec, T3)
        predicted, node = fit.peak(T3)
        assert predicted == max(direct.timeline) + direct.batch_bytes, (spec.checkpoint, node)


def test_one_capture_serves_the_checkpointed_and_the_plain_layout(small_captures):
    """The plain timeline recorded from the checkpointed spec's capture (before the checkpoint
    pass rewrote that graph) is the timeline of a capture made without checkpointing."""
    spec = SMALL[1]
    T = P.fit_points(spec.cp)[0]
    recorded = plan_graphs.cached(spec.plain, T)
    assert recorded is not None  # stored by the checkpointed capture: no plain capture was requested
    direct = plan_graphs.capture_timelines(spec.plain, T)[spec.plain]
    assert recorded.ops_digest == direct.ops_digest and recorded.timeline == direct.timeline
    checkpointed = P.measure(spec, T)
    assert checkpointed.ops_digest != direct.ops_digest and max(checkpointed.timeline) < max(direct.timeline)


def test_memory_grows_with_T_and_shrinks_with_gpus(small_captures):
    spec = SMALL[0]
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


def test_model_states_are_the_shards_the_engine_holds():
    """The planner's state term is read off the model sharded as ``compile(..., fsdp=...)`` shards
    it: on 3 GPUs, which divide none of "small"'s widths, every parameter's dim 0 is padded to
    ceil(p/3) rows, and the accumulator, the compute copy and AdamW scale with that shard."""
    import torch
    from longshield_fx.models import Llama

    with torch.device("meta"):
        lm = Llama.from_name("small")
    padded = sum(math.ceil(p.shape[0] / 3) * math.prod(p.shape[1:]) for p in lm.parameters())
    stats = P.model_stats("small")
    assert stats.shard_numel(3) == padded > stats.params / 3
    params, grads, optimizer, _ = P.state_bytes(stats, 3, "bf16")
    assert (params, grads, optimizer) == (2 * padded, 4 * padded, 12 * padded)
    assert stats.shard_numel(1) == stats.params and stats.shard_numel(math.inf) == 0


def test_model_stats_match_llama_parameter_counts():
    assert P.model_stats("llama3.2-1b").params == pytest.approx(1.236e9, rel=0.01)
    assert P.model_stats("llama3.2-3b").params == pytest.approx(3.213e9, rel=0.01)
    eight = P.model_stats("llama3.1-8b")
    assert eight.params == pytest.approx(8.03e9, rel=0.01)
    # the largest FSDP units: the final norm + output head, then the (untied) embedding
    assert eight.units[:2] == (128256 * 4096 + 4096, 128256 * 4096)


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama-9000", "--gpus", "4", "--gpu-mem-gb", "80"],
     "--model llama-9000: neither one of llama3.2-1b, llama3.2-3b, llama3.1-8b nor a model directory"),
    (["--model", "llama3.2-1b", "--hf-config", "x.json", "--gpus", "4", "--gpu-mem-gb", "80"],
     "--model and --hf-config both name the model"),
    (["--hf-config", "missing.json", "--gpus", "4", "--gpu-mem-gb", "80"], "--hf-config: no such file: missing.json"),
    (["--model", "llama3.2-1b", "--gpus", "0", "--gpu-mem-gb", "80"], "--gpus: must be > 0"),
    (["--model", "llama3.2-1b", "--gpus", "-4", "--gpu-mem-gb", "80"], "--gpus: must be > 0"),
    (["--model", "llama3.2-1b", "--gpus", "4", "--gpu-mem-gb", "0"], "--gpu-mem-gb: must be > 0"),
    (["--model", "llama3.2-1b", "--gpus", "4", "--gpu-mem-gb", "-80"], "--gpu-mem-gb: must be > 0"),
    (["--model", "llama3.2-1b", "--gpus", "4", "--gpu-mem-gb", "80", "--cp", "3"], "--cp 3 does not divide --gpus 4"),
    (["--model", "llama3.2-1b", "--gpus", "6", "--gpu-mem-gb", "80", "--cp", "4"], "--cp 4 does not divide --gpus 6"),
    (["--gpus", "4", "--gpu-mem-gb", "80"], "required: --model"),
    (["--model", "llama3.2-1b", "--gpus", "four", "--gpu-mem-gb", "80"], "--gpus: expected an integer"),
    (["--model", "llama3.2-1b", "--gpus", "4", "--gpu-mem-gb", "80", "--overhead-gb", "-1"],
     "--overhead-gb: must be >= 0"),
    (["--model", "llama3.2-1b", "--gpus", "4", "--gpu-mem-gb", "80", "--seq-len", "100"],
     "--seq-len 100 must be a multiple of 2*cp = 8"),
    (["--model", "llama3.2-1b", "--gpus", "4", "--gpu-mem-gb", "80", "--hp", "3"], "--cp 1 x --hp 3 does not divide"),
    (["--model", "llama3.2-1b", "--gpus", "6", "--gpu-mem-gb", "80", "--hp", "3"],
     "--hp 3 does not divide llama3.2-1b's 32 attention heads"),
    (["--model", "llama3.2-1b", "--gpus", "4", "--gpu-mem-gb", "80", "--hp", "2", "--seq-len", "100"],
     "--seq-len 100 must be a multiple of 2*cp*hp = 8"),
])
def test_bad_requests_exit_nonzero_with_one_line(argv, message, capsys):
    try:
        code = cli.main(["plan", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    assert lines[0].startswith("longshield-fx plan: error: ")


def test_search_attention_prints_every_layout_and_the_chosen_mesh():
    """No capture: the cost model ranks the attention layouts of 8 ranks over two nodes; at 8k a
    single ring across the nodes exposes its hops, a double ring with node-local inner rings does not."""
    from longshield_fx.cli.plan import search_table

    table = search_table("llama3.1-8b", 8, 8192, 1, "bf16", "2x4-H100-IB").splitlines()
    rows = {line[:44].strip(): float(line[44:54]) for line in table[2:-1]}
    all_to_all = {line[:44].strip(): float(line.split()[-1]) for line in table[2:-1]}
    assert len(rows) == 15 and rows["hp=1 cp=8, double ring w=4"] < rows["hp=1 cp=8"] / 3
    # head-first: the all-to-alls stay inside a node, the cp ring crosses them (context-first: the reverse)
    assert all_to_all["hp=2 cp=4, head-first"] < all_to_all["hp=2 cp=4, context-first"] / 3
    best = min(rows, key=rows.get)
    assert table[-1].startswith(f"chosen: {best} ") and "mesh dims ('cp',), compile(..., inner_ring=4)" in table[-1]


# --- the paper's ordering claim, real shapes -----------------------------------------------------------

@pytest.fixture(scope="module")
def plans_4x80(captures):
    """model -> (FSDP-style, DP cp=4, DP cp=4 + block) at 4 x 80 GiB, MBS 1, bf16: 12 captures
    at the real Llama shapes (two per layout; the checkpointed cp=4 capture brings the plain
    cp=4 graph along)."""
    cache = _cache_dir()
    out = {}
    for model in P.MODELS:
        block, fsdp = P.plan(model, 4, 80.0, cp=4, checkpoint="block", cache_dir=cache)
        plain = P.plan_layout("DP cp=4", P.GraphSpec(model, 4, None, 1, "bf16"), gpus=4, gpu_mem_gib=80.0,
                              cache_dir=cache)
        out[model] = fsdp, plain, block
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model", P.MODELS)
def test_cp4_reaches_4x_the_fsdp_context_and_block_checkpointing_more(model, plans_4x80):
    fsdp, plain, block = plans_4x80[model]
    assert plain.max_T is not None, f"{model}: DP cp=4 fits no context at all"
    assert plain.max_T >= 4 * (fsdp.max_T or 0), (fsdp.max_T, plain.max_T)
    assert block.max_T is not None and block.max_T > plain.max_T, (plain.max_T, block.max_T)
    for lp in (fsdp, plain, block):
        if lp.max_T:
            assert lp.at_max.total <= 80 * P.GiB < lp.breakdown(2 * lp.max_T).total
    # ... and the summary row of benchmarks/results/planner.md says so
    row = summary_row(ModelPlans(model, v3=block, v2={1: plain}, fsdp={(4, 1): fsdp}))
    assert row.endswith("| yes | yes |"), row


@pytest.mark.slow
def test_main_prints_the_plan(plans_4x80, capsys):
    """``longshield-fx plan`` end to end (the captures it needs are memoised by now)."""
    assert cli.main(["plan", "--model", "llama3.2-1b", "--gpus", "4", "--gpu-mem-gb", "80", "--checkpoint", "block",
                     "--cache-dir", "", "--jobs", "1", "--seq-len", "65536"]) == 0
    out = capsys.readouterr().out
    fsdp, _, block = plans_4x80["llama3.2-1b"]
    assert "DP cp=4 block" in out and "FSDP-style cp=1" in out
    for lp in (block, fsdp):
        assert P.tokens(lp.max_T) in out
    for column in ("params", "grads", "optimizer", "gathered", "graph", "overhead", "total"):
        assert column in out
    assert "at T = 65536" in out
    assert "ZeRO-3 over all 4 GPUs as compile(mesh, fsdp=<every mesh dim>) shards them" in out  # the layout planned
    assert math.isfinite(block.at_max.total)


def _report_row(out: str, title: str) -> list[str]:
    """The cells of ``format_plan``'s row for layout ``title``: max T, then the GiB columns."""
    row = next(line for line in out.splitlines() if line.startswith(f"{title} "))
    return row[len(title):].split()


@pytest.mark.slow
def test_llama8b_block_at_cp4_reaches_64k_and_the_report_names_the_model_state_layout(plans_4x80, capsys):
    """Issue 14: ``plan --model llama3.1-8b --gpus 4 --gpu-mem-gb 80 --cp 4 --checkpoint block``
    (the captures are memoised by now) still reaches the paper's 64k with the model states
    sharded as the engine shards them, and its report says which layout those states are: the
    state columns printed are the engine's ZeRO-3 shard over the 4 GPUs."""
    _, _, block = plans_4x80["llama3.1-8b"]
    assert block.max_T is not None and block.max_T >= 65536, block.max_T
    assert cli.main(["plan", "--model", "llama3.1-8b", "--gpus", "4", "--gpu-mem-gb", "80", "--cp", "4",
                     "--checkpoint", "block", "--cache-dir", "", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "model states: ZeRO-3 over all 4 GPUs as compile(mesh, fsdp=<every mesh dim>) shards them" in out
    assert "each Shard(0) with dim 0 padded to ceil(p/N) rows" in out
    cells = _report_row(out, "DP cp=4 block")
    assert cells[0] == P.tokens(block.max_T)
    stats = P.model_stats("llama3.1-8b")
    params, grads, optimizer, _ = P.state_bytes(stats, 4, "bf16")
    assert params == 2 * stats.shard_numel(4)  # the bf16 copy of the engine's shard, not params / 4
    assert cells[1:4] == [f"{b / P.GiB:.2f}" for b in (params, grads, optimizer)]


@pytest.mark.slow
def test_main_plans_2d_attention_with_hp2(plans_4x80, capsys):
    """``plan --hp 2`` end to end on 4 GPUs (cp = 4 / hp = 2): the graph of one hp=2 x cp=2 rank
    is planned. Every tensor outside attention holds T/4 tokens per rank as under cp=4, and
    attention's are the same size (H/2 heads x T/2 tokens vs H heads x T/4), so it reaches the
    same context as plain cp=4; the all-to-all buffers show up as a slightly larger graph."""
    assert cli.main(["plan", "--model", "llama3.2-1b", "--gpus", "4", "--gpu-mem-gb", "80", "--hp", "2",
                     "--cache-dir", "", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    fsdp, plain_cp4, _ = plans_4x80["llama3.2-1b"]
    two_d = P.plan_layout("DP cp=2 hp=2", HP2, gpus=4, gpu_mem_gib=80.0)
    assert two_d.fit.T_points == (4096, 8192)  # 1024 and 2048 tokens per rank, over hp x cp = 4 ranks
    cells = _report_row(out, "DP cp=2 hp=2")
    assert cells[0] == P.tokens(two_d.max_T) and _report_row(out, "FSDP-style cp=1")[0] == P.tokens(fsdp.max_T)
    assert two_d.max_T == plain_cp4.max_T, (two_d.max_T, plain_cp4.max_T)
    T = two_d.max_T
    assert two_d.breakdown(T).graph >= plain_cp4.breakdown(T).graph


def test_a_hugging_face_model_is_planned_from_its_config(qwen, captures, capsys):
    """`plan --model DIR` and `--hf-config PATH` plan any HF causal LM from its config alone: the
    model states are the real module's parameters and blocks, the per-node affine fit predicts a
    direct capture at a third T, and both flags give the same plan."""
    import torch
    import transformers

    folder, config, spec = qwen
    lm = transformers.AutoModelForCausalLM.from_config(config)
    stats = P.model_stats(spec.model)
    assert stats.params == sum(p.numel() for p in lm.parameters())
    blocks = [sum(p.numel() for p in block.parameters()) for block in lm.model.layers]
    assert sorted(stats.units) == sorted(blocks + [lm.model.embed_tokens.weight.numel(),
                                                   lm.lm_head.weight.numel() + lm.model.norm.weight.numel()])
    from longshield_fx.cli.models import load_config_json
    # Where a config was read from is not part of its spec: the two flags share one capture.
    assert plan_graphs.hf_model(load_config_json(str(folder / "config.json"))) == spec.model
    T3 = third_T(spec)
    predicted, node = P.fit_graph(spec).peak(T3)
    direct = P.measure(spec, T3)
    assert predicted == pytest.approx(max(direct.timeline) + direct.batch_bytes, rel=0.02), node
    tables = []
    for flag in (["--model", folder / "model"], ["--hf-config", folder / "config.json"]):
        argv = ["plan", *flag, "--gpus", 1, "--gpu-mem-gb", 4, "--overhead-gb", 0, "--cache-dir", "", "--jobs", 1]
        assert cli.main([str(a) for a in argv]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("longshield-fx plan: HF qwen2 (2 layers), 1 x 4 GiB"), out[0]
        tables.append(out[1:])
    assert tables[0] == tables[1] and any(line.startswith("DP cp=1") and "OOM" not in line for line in tables[0])
    assert torch.float32 == torch.get_default_dtype()  # the planner's bf16 build left the default alone
