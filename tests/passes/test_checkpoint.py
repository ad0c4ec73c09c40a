"""checkpoint: same gradients as plain; activations recomputed; memory flat across steps."""
import gc

import pytest
import torch

import longshield_fx as lf
from longshield_fx.passes._context import KEEP_SELECTIVE
from longshield_fx.passes.checkpoint import region_of
from longshield_fx.tools.memory import estimate_memory

from oracles import hf_llama, logical, tiny_llama, token_batch

MODELS = {"llama": (lambda: tiny_llama(n_layers=3), 256), "hf_llama": (hf_llama, 128)}
C = 0.05  # small enough that some sample is clipped


@pytest.fixture(scope="module")
def run():
    """``run(model, policy)``: per-sample gradients, the clipped gradient and the engine of one
    step on a (2, 24) batch; memoised, so the plain run serves both policies (read only)."""
    cache = {}

    def get(name, policy):
        if (name, policy) not in cache:
            make, vocab = MODELS[name]
            batch = token_batch(B=2, T=24, vocab=vocab)
            model = make()
            engine = lf.compile(model, config=lf.DPConfig(C, 0.0), checkpoint=policy)
            per_sample = engine.per_sample_grads(*batch)
            engine.accumulate(*batch)
            engine.finalize(logical(batch[0].shape[0]))
            cache[name, policy] = (per_sample, {n: p.grad for n, p in model.named_parameters()}, engine, batch)
        return cache[name, policy]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("policy", ["block", "selective"])
def test_same_gradients_as_plain(run, name, policy):
    ps_plain, clipped_plain, _, _ = run(name, None)
    ps_ck, clipped_ck, engine, batch = run(name, policy)
    assert engine.last_norms.gt(C).any()
    assert set(ps_ck) == set(ps_plain) and set(clipped_ck) == set(clipped_plain)
    for name in ps_plain:
        torch.testing.assert_close(ps_ck[name], ps_plain[name], atol=1e-6, rtol=0)
        torch.testing.assert_close(clipped_ck[name], clipped_plain[name], atol=1e-6, rtol=0)
    lowered = engine.lower(*batch)
    assert lowered.passes[-1] == "checkpoint"
    recomputed = [n for n in lowered.gm.graph.nodes if n.meta.get("recomputed")]
    assert recomputed
    # Recomputed activations feed the per-sample work: einsums, or ghost norms' float64 Grams.
    per_sample_work = [n for n in lowered.gm.graph.nodes if n.target == torch.ops.aten.einsum.default
                       or n.kwargs.get("dtype") == torch.float64]
    assert any(a.meta.get("recomputed") for n in per_sample_work for a in n.all_input_nodes)
    if policy == "selective":  # attention is kept, not recomputed
        assert not any("attention" in str(n.target) for n in recomputed)


def test_no_forward_activation_of_a_block_outlives_its_forward(run):
    """With "block", a block-internal forward node is read by the forward only; without
    checkpointing, some are kept for the backward (so the check can see a violation)."""
    def kept_for_backward(engine, batch):
        checked, kept = 0, []
        for node in engine.lower(*batch).gm.graph.nodes:
            if node.meta.get("partitioner_tag") != "is_forward" or region_of(node) is None:
                continue
            checked += 1
            backward_users = [u for u in node.users if u.meta.get("partitioner_tag") == "is_backward"]
            forward_users_outside = [u for u in node.users if u.meta.get("partitioner_tag") == "is_forward"
                                     and region_of(u) != region_of(node)]
            if backward_users and not forward_users_outside:
                kept.append(node.name)
        assert checked > 0
        return kept

    *_, plain, batch = run("llama", None)
    *_, block, _ = run("llama", "block")
    assert kept_for_backward(plain, batch)
    assert kept_for_backward(block, batch) == []


@pytest.mark.slow
def test_memory_estimate_drops_with_checkpointing():
    ids = torch.zeros(1, 512, dtype=torch.long)
    peaks = {}
    for policy in (None, "selective", "block"):
        engine = lf.compile(tiny_llama(n_layers=4), config=lf.DPConfig(1.0, 0.0), checkpoint=policy)
        peaks[policy] = estimate_memory(engine.lower(ids, ids).gm).peak_bytes
    assert peaks["block"] * 2 < peaks[None]
    assert peaks["selective"] < peaks[None]
    # (block <= selective holds at the benchmark's 8-layer T=4096 shape, not at every tiny shape:
    # see benchmarks/checkpointing.py)


def test_memory_is_flat_across_steps():
    """After the first step, the live tensors (count and bytes) do not change from step to
    step: a tensor kept per step would add one per step. Scanning every object costs far
    more than a step here, so the scan runs after steps 2, 7 and 12 only."""
    model = tiny_llama(n_layers=2)
    engine = lf.compile(model, config=lf.DPConfig(1.0, 0.5), checkpoint="block")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))

    def live_tensors():
        gc.collect()
        # Real tensors only: fake tensors left in dynamo's caches by earlier captures in this
        # process (symbolic sizes, from Hugging Face models) are not memory.
        objs = [o for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)]
        return len(objs), sum(o.numel() * o.element_size() for o in objs if not o.is_meta)

    counts = []
    for step in range(1, 13):
        engine.accumulate(ids, ids)
        engine.finalize(logical(2, 2.0))
        opt.step()
        opt.zero_grad()
        if step in (2, 7, 12):
            counts.append(live_tensors())
    assert len(set(counts)) == 1, counts


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="checkpoint must be None, 'block' or 'selective'"):
        lf.compile(tiny_llama(), config=lf.DPConfig(1.0, 0.0), checkpoint="everything")


@pytest.mark.parametrize("n_kv_heads", [2, 1], ids=["hkv2-moved", "hkv1-replicated"])
@pytest.mark.parametrize("policy, recomputed", [("selective", 0), ("block", 8)])
def test_2d_attention_all_to_alls_are_kept_by_selective_and_recomputed_by_block(fake_world, policy, recomputed,
                                                                                n_kv_heads):
    """hp=2 x cp=2, 2 layers: selective keeps the ring's inputs and the output after their
    all-to-alls, so the backward issues only its own four per layer; block recomputes the
    forward's four (and the ring) per layer. With one K/V head (replicated to hp=2 before its
    all-to-all) the count is the same: the replicas travel in the k and v all-to-alls."""
    a2a = torch.ops._c10d_functional.all_to_all_single.default
    ring_fwd = torch.ops.longshield.ring_attention.default
    ring_bwd = torch.ops.longshield.ring_attention_backward.default
    ids = torch.zeros(2, 16, dtype=torch.long)
    with fake_world(2, hp=2) as mesh:
        model = tiny_llama(n_kv_heads=n_kv_heads)
        gm = lf.compile(model, mesh, config=lf.DPConfig(1.0, 0.0), checkpoint=policy).lower(ids, ids).gm
    layers = len(model.lm.layers)
    nodes = list(gm.graph.find_nodes(op="call_function", target=a2a))
    assert sum(bool(n.meta.get("recomputed")) for n in nodes) == recomputed
    assert len(nodes) == 8 * layers + recomputed
    rings = list(gm.graph.find_nodes(op="call_function", target=ring_fwd))
    backwards = list(gm.graph.find_nodes(op="call_function", target=ring_bwd))
    assert len(backwards) == layers
    # The ring backward reads the forward ring's output and log-sum-exp (args 4, 5): under
    # selective the forward's own getitems (kept), under block those of the recomputed ring.
    read = [(bwd.args[4].args[0], bwd.args[5].args[0]) for bwd in backwards]
    assert all(out_of is lse_of and out_of.target == ring_fwd for out_of, lse_of in read)
    if policy == "selective":
        assert len(rings) == layers and not any(n.meta.get("recomputed") for n in rings)
        assert all(not bwd.args[i].meta.get("recomputed") for bwd in backwards for i in range(1, 6))
        # the attention output after its all-to-all feeds wo's per-sample einsum: kept too
        kept_outputs = [n for n in gm.graph.nodes if n.meta.get(KEEP_SELECTIVE)]
        assert len(kept_outputs) == 4 * layers  # q, k, v after the all-to-all, the output after it
        assert not any(n.meta.get("recomputed") for n in kept_outputs)
        assert all(any(u.meta.get("partitioner_tag") == "is_backward" for u in n.users) for n in kept_outputs)
    else:
        assert sum(bool(n.meta.get("recomputed")) for n in rings) == layers == len(rings) - layers
        assert all(out_of.meta.get("recomputed") for out_of, _ in read)
