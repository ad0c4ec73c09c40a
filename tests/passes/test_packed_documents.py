"""Packed documents through the passes (``compile(..., packed_units=U)``): each unit's
gradient, norm and clipped contribution against the unit run alone, each of its pieces in a
row of its own (``CausalLMLoss``, plain autograd); isolation between the units of a row;
fixed shapes; refusals."""
import math
from operator import getitem

import pytest
import torch

import longshield_fx as lf
from longshield_fx.data import LogicalBatch
from longshield_fx.errors import UnsupportedModelError
from longshield_fx.models.llama import Attention, Llama
from longshield_fx.packing import pack_documents

from oracles import PACKED_CFG as CFG, PACKED_C as C, PACKED_ROWS as ROWS, PACKED_T as T, PACKED_U as U
from oracles import packed_alone as _alone, packed_hf as _hf, packed_units as _units
from oracles import packed_alone, packed_model, packed_units

@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    lm = Llama(CFG)
    engine = lf.compile(lf.PackedCausalLMLoss(lm), config=lf.DPConfig(max_grad_norm=C, noise_multiplier=0.0,
                                                                      insecure_seed=0), packed_units=U)
    return lm, engine


def _close(a: dict, b: dict, rtol: float = 1e-5) -> float:
    """Largest difference, relative to the largest entry of b's gradients."""
    scale = max(float(v.abs().max()) for v in b.values())
    err = max(float((a[n] - b[n]).abs().max()) for n in b) / scale
    assert err <= rtol, err
    return err


def test_per_unit_gradients_equal_each_unit_alone(setup):
    lm, engine = setup
    units = _units()
    batches, stats = pack_documents(units, seq_len=T, rows=ROWS, unit_slots=U)
    assert len(batches) >= 2 and stats.pieces_per_row > 1  # rows shared, and a second physical batch
    spans_rows = 0
    for pb in batches:
        grads = engine.per_sample_grads(*pb.tensors())
        assert all(g.shape[0] == U for g in grads.values())
        for slot, unit in enumerate(pb.members):
            spans_rows += int((pb.units == slot).any(1).sum() > 1)
            _close({n: g[slot] for n, g in grads.items()}, _alone(lm, units[unit]))
        for slot in range(len(pb.members), U):  # an empty slot is no sample
            assert all(float(g[slot].abs().max()) == 0 for g in grads.values())
    assert spans_rows >= 2
    assert engine.captures == 1  # batches of other units and lengths: the same graph


@pytest.mark.parametrize("ghost", [True, False])
def test_clipped_sum_and_norms_equal_the_units_alone(setup, ghost):
    """With ghost norm and book-keeping (the cost model picks it for the wider linear weights at
    U = 8) and without (per-unit gradients by one grouped matmul)."""
    lm, engine = setup
    if not ghost:
        engine = lf.compile(lf.PackedCausalLMLoss(lm), config=engine.config, packed_units=U,
                            disable_passes=("ghost_norm",))
    units = _units(seed=2)
    (pb, *rest), _ = pack_documents(units, seq_len=T, rows=ROWS, unit_slots=U)
    methods = engine.lower(*pb.tensors()).norm_methods
    ghosts = [n for n, m in methods.items() if m.startswith("ghost")]
    assert bool(ghosts) == ghost and len(ghosts) < len(methods), methods  # ghost layers beside per-unit ones
    _check_clipped_sum(lm, engine, units, pb)


def _check_clipped_sum(lm, engine, units, pb):
    """One physical batch accumulated and finalized without noise: each unit's norm and the
    clipped sum against the units alone."""
    lm.zero_grad()
    engine.accumulate(*pb.tensors())
    norms = engine.last_norms
    expected = None
    for slot, unit in enumerate(pb.members):
        g = _alone(lm, units[unit])
        norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in g.values()))
        assert norms[slot].item() == pytest.approx(norm, rel=1e-5)
        factor = min(1.0, C / (norm + 1e-6))
        expected = {n: v * factor + (expected[n] if expected else 0) for n, v in g.items()}
    assert bool((norms[len(pb.members):] == 0).all())
    engine.finalize(LogicalBatch(len(pb.members), torch.arange(len(pb.members)), [], 1.0, 1.0))
    _close({f"lm.{n}": p.grad for n, p in lm.named_parameters()}, expected)


def test_one_document_never_reaches_another(setup):
    """Every token of one document replaced: every other unit's loss and gradient unchanged."""
    lm, engine = setup
    units = _units(seed=3)
    (pb, *_), _ = pack_documents(units, seq_len=T, rows=ROWS, unit_slots=U)
    slots = range(len(pb.members))
    # the victim: a unit sharing a row with another
    victim = next(v for v in slots if any(bool((pb.units[r] == v).any() & (pb.units[r] == s).any())
                                          for r in range(ROWS) for s in slots if s != v))
    ids = pb.input_ids.clone()
    where = pb.units == victim
    ids[where] = (ids[where] + 17) % CFG.vocab_size
    labels = pb.labels.clone()
    labels[where] = ids[where]
    before = engine.per_sample_grads(*pb.tensors())
    after = engine.per_sample_grads(ids, labels, pb.position_ids, pb.units)
    changed = max(float((before[n][victim] - after[n][victim]).abs().max()) for n in before)
    assert changed > 1e-3  # the victim's own gradient did change
    others = [s for s in slots if s != victim]
    diff = max(float((before[n][s] - after[n][s]).abs().max()) for n in before for s in others)
    assert diff <= 1e-6, diff
    model = lf.PackedCausalLMLoss(lm)
    row_loss = model(*pb.tensors())
    row_loss_after = model(ids, labels, pb.position_ids, pb.units)
    for r in range(ROWS):
        if not bool((pb.units[r] == victim).any()):
            assert torch.equal(row_loss[r], row_loss_after[r])


@pytest.mark.parametrize("policy", ["block", "selective"])
def test_checkpointed_equals_plain(setup, policy):
    lm, engine = setup
    (pb, *_), _ = pack_documents(_units(seed=6), seq_len=T, rows=ROWS, unit_slots=U)
    checkpointed = lf.compile(lf.PackedCausalLMLoss(lm), config=engine.config, checkpoint=policy, packed_units=U)
    record = checkpointed.lower(*pb.tensors()).log[-1]
    assert record.name == "checkpoint" and record.nodes_after > record.nodes_before  # it recomputes
    results = []
    for e in (engine, checkpointed):
        e.accumulate(*pb.tensors())
        norms = e.last_norms.clone()
        e.finalize(LogicalBatch(len(pb.members), torch.arange(len(pb.members)), [], 1.0, 1.0))
        results.append((norms, {n: p.grad.clone() for n, p in lm.named_parameters()}))
    (n0, g0), (n1, g1) = results
    torch.testing.assert_close(n1, n0, rtol=1e-6, atol=0)
    _close(g1, g0, rtol=1e-6)


def test_under_block_checkpointing_nothing_of_a_block_lives_from_the_forward_to_the_backward(setup):
    """The per-unit gradients read each linear layer's input as token rows, in the batch's own
    order: no copy of them is made (a sorted copy per layer was, made in the forward it kept
    every layer's activations alive until the backward: at llama3.2-1b's shapes the packed
    graph's peak grew from 22 to 130 GiB between 2 x 4k and 2 x 32k tokens). Block checkpointing
    recomputes their inputs in the backward: every recomputed node and every segment op comes
    after the forward's last node, and no segment op reads a gather or a sort."""
    lm, engine = setup
    (pb, *_), _ = pack_documents(_units(seed=6), seq_len=T, rows=ROWS, unit_slots=U)
    checkpointed = lf.compile(lf.PackedCausalLMLoss(lm), config=engine.config, checkpoint="block", packed_units=U)
    nodes = list(checkpointed.lower(*pb.tensors()).gm.graph.nodes)
    last_forward = max(i for i, n in enumerate(nodes) if n.meta.get("partitioner_tag") == "is_forward")
    recomputed = [i for i, n in enumerate(nodes) if n.meta.get("recomputed")]
    segment_ops = {getattr(torch.ops.longshield, op).default for op in (
        "segment_outer", "segment_outer_norms", "segment_outer_clipped_sum", "segment_sq_norm", "segment_book_keeping")}
    readers = [i for i, n in enumerate(nodes) if n.target in segment_ops]
    assert recomputed and readers
    assert min(recomputed) > last_forward, [nodes[i].name for i in recomputed if i < last_forward][:5]
    assert min(readers) > last_forward, [nodes[i].name for i in readers if i < last_forward][:5]
    gathers = (torch.ops.aten.index_select.default, torch.ops.aten.sort.stable, torch.ops.aten.sort.default)
    assert not [n.name for i in readers for n in nodes[i].all_input_nodes if n.target in gathers]


def test_a_layers_token_rows_are_let_go_after_its_per_unit_norms_where_every_product_is_held(setup):
    """A linear layer's per-unit products and norms are formed where its weight gradient was, as
    soon as both operands are; where every slot's product is held the clipped sum reads no token
    row, so those rows are not kept, with every other layer's, until the clip factors are known.
    They were: by ``tools.memory``, llama3.2-1b on 2 x 32k rows with block checkpointing held 98
    GiB of intermediates at the peak, 17.7 GiB now. Where fewer products are held than slots
    (this model's 32 x 48 weights), the sum forms the rest again and reads the rows."""
    lm, engine = setup
    (pb, *_), _ = pack_documents(_units(seed=6), seq_len=T, rows=ROWS, unit_slots=U)
    checkpointed = lf.compile(lf.PackedCausalLMLoss(lm), config=engine.config, checkpoint="block", packed_units=U,
                              disable_passes=("ghost_norm",))
    nodes = list(checkpointed.lower(*pb.tensors()).gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    ops = torch.ops.longshield
    norms = [n for n in nodes if n.target is ops.segment_outer_norms.default]
    sums = {n.args[4]: n for n in nodes if n.target is ops.segment_outer_clipped_sum.default}
    held_all = []
    for node in norms:
        later = max(node.args[:2], key=position.__getitem__)
        between = nodes[position[later] + 1:position[node]]
        assert all(n.target in (ops.segment_outer_norms.default, getitem) for n in between), (node.name, between)
        held = next(u for u in node.users if u.args[1] == 1)
        clipped = sums[held]
        if node.args[4] >= U:
            held_all.append(node.name)
            assert clipped.args[:2] == (None, None)
            late = [u.name for operand in node.args[:2] for u in operand.users
                    if position[u] > position[node] and u.target is not ops.segment_outer_norms.default]
            assert not late, (node.name, late)
        else:
            assert clipped.args[:2] == node.args[:2]
    assert held_all and len(held_all) < len(norms)


@pytest.mark.parametrize("ghost", [True, False])
def test_the_unit_slots_change_no_value(setup, ghost):
    """The same tokens and units at U = 8 (fewer than the 4 units a row the cost model guesses),
    32 and 1024 slots (the extra slots empty), by ghost norm and book-keeping (the cost model's
    choice for these small layers) and by per-unit products (ghost_norm off): the same norm
    methods, and bitwise the same per-unit norms and clipped sum.
    The work of every op follows the units present, and no value depends on the slots a fixed
    shape reserves (not even the book-keeping's rounding allowance, counted by tokens)."""
    lm, engine = setup
    units = _units(seed=2)
    (pb, *_), _ = pack_documents(units, seq_len=T, rows=ROWS, unit_slots=U)
    results = []
    for slots in (U, 32, 1024):
        relabelled = torch.where(pb.units == U, slots, pb.units)  # U was the padding slot
        e = lf.compile(lf.PackedCausalLMLoss(lm), config=engine.config, packed_units=slots,
                       disable_passes=() if ghost else ("ghost_norm",))
        batch = (pb.input_ids, pb.labels, pb.position_ids, relabelled)
        methods = e.lower(*batch).norm_methods
        lm.zero_grad()
        e.accumulate(*batch)
        norms = e.last_norms.clone()
        assert bool((norms[len(pb.members):] == 0).all())
        e.finalize(LogicalBatch(len(pb.members), torch.arange(len(pb.members)), [], 1.0, 1.0))
        results.append((methods, norms[:len(pb.members)], {n: p.grad.clone() for n, p in lm.named_parameters()}))
    (m0, n0, g0), *others = results
    assert any(m.startswith("ghost") for m in m0.values()) == ghost
    for methods, norms, grads in others:
        assert methods == m0
        assert torch.equal(norms, n0)
        assert all(torch.equal(grads[n], g0[n]) for n in g0)


def test_adding_a_unit_moves_the_clipped_sum_by_at_most_c(setup):
    lm, engine = setup
    units = _units(seed=4)

    def clipped_sum(us):
        sums = None
        for pb in pack_documents(us, seq_len=T, rows=ROWS, unit_slots=U)[0]:
            engine.accumulate(*pb.tensors())
        engine.finalize(LogicalBatch(len(us), torch.arange(len(us)), [], 1.0, 1.0))
        sums = {n: p.grad.double().clone() for n, p in lm.named_parameters()}
        return sums

    with_all, without = clipped_sum(units), clipped_sum(units[:3] + units[4:])
    moved = math.sqrt(sum(float((with_all[n] - without[n]).pow(2).sum()) for n in with_all))
    assert 0.5 * C < moved <= C * (1 + 1e-6)


def test_segments_follow_units_and_positions_whatever_the_labels(setup):
    """Two units back to back with continuing positions and labels that cross between them:
    still two segments, and the boundary pair is not predicted."""
    lm, _ = setup
    loss = lf.PackedCausalLMLoss(lm)
    plain = lf.CausalLMLoss(lm)
    a, b = torch.randint(0, 64, (1, 6)), torch.randint(0, 64, (1, 10))
    ids = torch.cat([a, b], 1)
    units = torch.tensor([[0] * 6 + [1] * 10])
    got = loss(ids, ids, torch.arange(16)[None], units)
    with torch.no_grad():
        assert got.item() == pytest.approx((plain(a, a) + plain(b, b)).item(), rel=1e-5)


def test_refusals(setup, fake_world):
    lm, engine = setup
    (pb, *_), _ = pack_documents(_units(), seq_len=T, rows=ROWS, unit_slots=U)
    with pytest.raises(ValueError, match="packed batches take no mask"):
        engine.accumulate(*pb.tensors(), mask=torch.ones(ROWS))
    bad = pb.units.clone()
    bad[0, 0] = U + 1
    with pytest.raises(ValueError, match=r"unit slots must lie in \[0, 8\]"):
        engine.per_sample_grads(pb.input_ids, pb.labels, pb.position_ids, bad)
    with fake_world(1, hp=2) as mesh, pytest.raises(ValueError, match=r"not yet over an 'hp' dim \(2D attention\)"):
        lf.compile(lf.PackedCausalLMLoss(lm), mesh, packed_units=U)
    with fake_world(1, dp=2) as mesh:
        assert lf.compile(lf.PackedCausalLMLoss(lm), mesh, packed_units=U).parallel.dp == 2
    with fake_world(2) as mesh, pytest.raises(ValueError, match="wrap the model in longshield_fx.PackedCausalLMLoss"):
        lf.compile(lf.CausalLMLoss(lm), mesh, packed_units=U)
    with pytest.raises(ValueError, match="do not run in float16"):
        lf.compile(lf.PackedCausalLMLoss(lm), config=lf.DPConfig(1.0, 1.0, compute_dtype=torch.float16), packed_units=U)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="packed_units must be an int > 0"):
            lf.compile(lf.PackedCausalLMLoss(lm), packed_units=bad)
    with pytest.raises(ValueError, match="needs at least 2 rows"):
        lf.compile(lf.PackedCausalLMLoss(lm), packed_units=U).per_sample_grads(*(t[:1] for t in pb.tensors()))


def test_under_cp_the_document_attention_gets_the_ring(setup, fake_world, monkeypatch):
    """cp=2 (a fake group: shapes and nodes, nothing sent): every layer's document attention, forward
    and backward, runs on the cp group's ring with the tokens' segment ids; the sequence is cut
    in two; the per-unit gradients are reduce-scattered over cp and the counts all-reduced. An
    attention kernel that is not the document op is refused."""
    lm, _ = setup
    (pb, *_), _ = pack_documents(_units(), seq_len=T, rows=ROWS, unit_slots=U)
    ring_ops = (torch.ops.longshield.ring_attention.default, torch.ops.longshield.ring_attention_backward.default)
    with fake_world(2) as mesh:
        engine = lf.compile(lf.PackedCausalLMLoss(lm), mesh, config=lf.DPConfig(C, 0.0), packed_units=U)
        graph = engine.lower(*pb.tensors(), graph="per_sample").gm.graph
        rings = [n for n in graph.nodes if n.target in ring_ops]
        assert len(rings) == 2 * CFG.n_layers
        for n in rings:
            at = 4 if n.target == ring_ops[0] else 7
            assert n.args[at:at + 3] == (mesh["cp"].get_group().group_name, 2, 0), n.args
            assert tuple(n.args[at + 3].meta["val"].shape) == (ROWS, T // 2)  # this rank's segment ids
        # The isolation probe runs the train graph, whose collectives on a fake group return garbage.
        monkeypatch.setattr(engine, "_check_units_apart", lambda *args: None)
        train = engine.lower(*pb.tensors()).gm.graph
        collectives = {str(n.target) for n in train.nodes if "c10d" in str(n.target)}
        assert {"_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_reduce.default"} <= collectives
        # An attention that ignores the segment ids (plain causal SDPA) would become plain causal
        # ring attention, across documents: refused.
        attend = Attention.forward
        monkeypatch.setattr(Attention, "forward", lambda self, x, cos, sin, segment_ids=None: attend(self, x, cos, sin))
        engine = lf.compile(lf.PackedCausalLMLoss(lm), mesh, config=lf.DPConfig(C, 0.0), packed_units=U)
        with pytest.raises(UnsupportedModelError, match="every attention must be the document attention"):
            engine.lower(*pb.tensors(), graph="per_sample")


def test_a_layer_without_a_per_unit_rule_is_refused_by_name():
    class Conv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 4)
            self.conv = torch.nn.Conv1d(4, 4, 3, padding=1)

        def forward(self, ids, labels, positions, units):
            h = self.conv(self.emb(ids).transpose(1, 2)).transpose(1, 2)
            return (h.sum(-1) * (labels >= 0) * (units >= 0)).sum(1)

    engine = lf.compile(Conv(), packed_units=2)
    ids = torch.randint(0, 16, (2, 6))
    units = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 2, 2, 2, 2]])
    with pytest.raises(UnsupportedModelError, match="conv.weight.*with packed documents.*--no-pack"):
        engine.per_sample_grads(ids, ids, torch.zeros_like(ids), units)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_hugging_face_models_per_unit_gradients(kind):
    """HF Llama and Qwen2 (RoPE) and GPT-2 (learned positions, LayerNorm, Conv1D) packed: each
    unit's gradient equals the unit alone; the mask is ours, not transformers' guess from positions."""
    lm = _hf(kind)
    engine = lf.compile(lf.PackedCausalLMLoss(lm), packed_units=U)
    units = _units(seed=5)
    (pb, *_), stats = pack_documents(units, seq_len=T, rows=ROWS, unit_slots=U)
    assert stats.pieces_per_row > 1
    grads = engine.per_sample_grads(*pb.tensors())
    for slot, unit in enumerate(pb.members):
        _close({n: g[slot] for n, g in grads.items()}, _alone(lm, units[unit]))
    engine = lf.compile(lf.PackedCausalLMLoss(lm), config=lf.DPConfig(max_grad_norm=C, noise_multiplier=0.0,
                                                                      insecure_seed=0), packed_units=U)
    assert any(m.startswith("ghost") for m in engine.lower(*pb.tensors()).norm_methods.values())
    _check_clipped_sum(lm, engine, units, pb)


class PackedTokenProducts(torch.nn.Module):
    """A linear layer whose loss is Σ_t v_t·fc(x_t) over packed rows: a unit's gradient is
    Σ_t v_t x_tᵀ over its tokens, so a unit's tokens can be made to cancel exactly."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x, v, units):
        return ((self.fc(x) * v).sum(-1) * (units >= 0)).sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clipping", ["flat", "per_layer", "automatic"])
def test_cancelling_tokens_of_a_packed_unit_stay_within_c(clipping, dtype):
    """Unit 0's tokens cancel (gradient 0, per-token products up to 2**100) and share rows with
    three ordinary units: under ghost norm and book-keeping per unit, its contribution alone and
    the sum's move when it is removed stay within C·(1+1e-6) in float64."""
    model = PackedTokenProducts()
    engine = lf.compile(model, config=lf.DPConfig(1.0, 0.0, clipping=clipping, compute_dtype=dtype), packed_units=4)
    g = torch.Generator().manual_seed(0)
    a, b, v = (torch.randn(16, generator=g) for _ in range(3))
    units = torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 2, 2, 3, 3, 3, 3]])  # unit 0 spans both rows
    for scale in (2 ** 20, 2 ** 40, 2 ** 100):
        x, w = torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 16, generator=g)
        x[units == 0] = torch.stack([a, b, -a, -b]) * math.sqrt(scale)
        w[units == 0] = v * math.sqrt(scale)
        x, w = x.to(dtype), w.to(dtype)
        assert engine.lower(x, w, units).norm_methods["fc.weight"].startswith("ghost")

        def clipped_sum(keep):
            u = torch.where(torch.isin(units, torch.tensor(keep)), units, 4)
            engine.accumulate(x, w, u)
            engine.finalize(LogicalBatch(len(keep), torch.tensor(keep), [], 1.0, 1.0))
            return model.fc.weight.grad.double().clone()

        alone = clipped_sum([0])
        assert float(alone.norm()) <= 1 + 1e-6, (scale, float(alone.norm()))
        moved = clipped_sum([0, 1, 2, 3]) - clipped_sum([1, 2, 3])
        assert float(moved.norm()) <= 1 + 1e-6, (scale, float(moved.norm()))
    assert engine.captures == 1


def test_hugging_face_attention_that_would_not_keep_documents_apart_is_refused():
    """Eager attention adds a 4-D mask to the scores (a boolean True as +1: nothing masked)."""
    import transformers
    config = transformers.LlamaConfig(vocab_size=CFG.vocab_size, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    eager = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with pytest.raises(UnsupportedModelError, match="attn_implementation='sdpa'.*'eager'.*--no-pack"):
        lf.PackedCausalLMLoss(eager)


def test_a_non_finite_unit_leaves_the_other_norms_of_its_tile_finite():
    """segment_sq_norm: one unit's inf never turns another unit's norm into nan (inf * 0)."""
    from longshield_fx.ops.segment import segment_sq_norm

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g)
    counts = torch.tensor([3, 3, 4])  # W = 4: all three short, in the same tiles
    unit = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 2])
    clean = segment_sq_norm(a, b, unit, counts)
    a[0, 0] = float("inf")
    dirty = segment_sq_norm(a, b, unit, counts)
    assert not torch.isfinite(dirty[0]) and torch.equal(dirty[1:], clean[1:])


class LeakyPackedModel(torch.nn.Module):
    """PackedTokenProducts with ``leak``: "causal" sums every earlier token of the row into each
    token (causal attention without a document mask), "label" adds each token's next token's
    value to its own loss term (a last token trained on the next unit's first)."""

    def __init__(self, leak: str | None):
        super().__init__()
        self.fc, self.leak = torch.nn.Linear(16, 16, bias=False), leak

    def forward(self, x, v, units):
        if self.leak == "causal":
            x = x.cumsum(1)
        y = self.fc(x) * v
        if self.leak == "label":
            y = y + torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], 1) * self.fc(x)
        return (y.sum(-1) * (units >= 0)).sum(1)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("leak", ["causal", "label", None])
def test_a_model_that_lets_the_units_of_a_row_reach_each_other_is_refused(leak, compute_dtype):
    """No pass can see whether a custom model's attention keeps units apart; the probe at capture
    varies one half of every row and watches the other half's unit: leaks are refused by name,
    also under bf16 compute, where the probe allows the rounding and the GPU kernels' run-to-run
    jitter (a norm moved by ~3e-6 on an H100, llama3.2-1b)."""
    torch.manual_seed(0)
    config = lf.DPConfig(1.0, 0.0, insecure_seed=0, compute_dtype=compute_dtype)
    engine = lf.compile(LeakyPackedModel(leak), config=config, packed_units=4)
    x, v = torch.randn(2, 8, 16, dtype=compute_dtype), torch.randn(2, 8, 16, dtype=compute_dtype)
    units = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2], [2, 2, 3, 3, 3, 3, 4, 4]])
    if leak is None:
        engine.accumulate(x, v, units)
        return
    with pytest.raises(UnsupportedModelError, match="lets the units of a row reach each other"):
        engine.accumulate(x, v, units)


@pytest.mark.parametrize("leak, jitter", [("causal", 1e-5), ("label", 1e-5), (None, 1e-5), (None, 3e-2)])
def test_the_probe_tells_the_kernels_run_to_run_jitter_from_a_leak(leak, jitter, monkeypatch, caplog):
    """On a GPU, kernels that accumulate with atomics move a correct model's norms from run to run:
    bf16 llama3.2-1b on an H200, 2 rows of 4k, no checkpointing, was refused for a unit's norm moved
    by 1.06e-4, over the bf16 tolerance. Simulated here: every probe run's norms scaled by
    1 + 1e-5 N(0, 1), ten times the fp32 tolerance. A correct model passes with a warning that names
    the jitter; leaks are still refused, their message naming it too; and a jitter of 3e-2, beyond
    what any kernel's rounding explains, is refused as a leak would be."""
    from longshield_fx.runtime.engine import Engine

    real, g = Engine._probe_norms, torch.Generator().manual_seed(0)

    def jittered(self, lowered, batch):
        norms = real(self, lowered, batch)
        return norms * (1 + jitter * torch.randn(norms.shape, generator=g, dtype=norms.dtype))
    monkeypatch.setattr(Engine, "_probe_norms", jittered)
    torch.manual_seed(0)
    engine = lf.compile(LeakyPackedModel(leak), config=lf.DPConfig(1.0, 0.0, insecure_seed=0), packed_units=4)
    x, v = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    units = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2], [2, 2, 3, 3, 3, 3, 4, 4]])
    if leak is None and jitter < 1e-4:
        with caplog.at_level("WARNING", logger="longshield_fx.runtime.engine"):
            engine.accumulate(x, v, units)
        assert "the unchanged batch's norms themselves moved" in caplog.text
        return
    with pytest.raises(UnsupportedModelError, match="reach each other") as refused:
        engine.accumulate(x, v, units)
    assert "from run to run" in str(refused.value)


@pytest.mark.parametrize("world, kind", [pytest.param(w, k, marks=pytest.mark.torchrun(w), id=f"cp{w}-{k}")
                                         for w, k in ((4, "ref-block"), (4, "ref-fsdp"), (4, "llama-cp4"), (2, "ref"),
                                                      (2, "llama"), (2, "qwen2"), (2, "gpt2"))])
def test_under_cp_each_unit_is_still_one_sample(distributed, world, kind):
    """Packed documents under context parallelism (``cp_worker.packed_case``): the reference Llama
    at cp=2, at cp=4 with block checkpointing and at dp=2 x cp=2 with ZeRO-3 over both (the physical
    batches dealt round the replicas), Hugging Face Llama at cp=2 and cp=4, and Qwen2 and GPT-2 at
    cp=2, with units spanning
    rows, physical batches and cp ranks. On every rank: each unit's gradient and norm
    equal the unit alone, and so does the clipped sum of all physical batches; leaving one unit
    out moves that sum by at most C; one unit's tokens replaced leave every other unit's
    gradient unchanged."""
    model = packed_model(kind.split("-")[0])
    units = packed_units(seed=5)
    alone = {}
    for rank, r in distributed.check(world, f"packed-{kind}").items():
        members = r["members"]
        assert len(members) >= 2 and r["victim_ranks"] == [True] * world  # batches; a unit on every rank
        assert r["captures"] == 2 and r["sharded"] == kind.endswith("fsdp")  # of 4 rows, and of 2 (the unit left out)
        for slot, unit in enumerate(members[0]):
            alone.setdefault(unit, packed_alone(model.lm, units[unit]))
            _close({n: g[slot] for n, g in r["per_unit"].items()}, alone[unit])
        expected = None
        assert r["norms"], rank
        for i, batch in enumerate(members):
            norms = r["norms"].get(i)
            for slot, unit in enumerate(batch):
                g = alone.setdefault(unit, packed_alone(model.lm, units[unit]))
                norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in g.values()))
                if norms is not None:  # the physical batches this rank's dp replica ran
                    assert float(norms[slot]) == pytest.approx(norm, rel=1e-5), (rank, unit)
                factor = min(1.0, C / (norm + 1e-6))
                expected = {n: v * factor + (expected[n] if expected else 0) for n, v in g.items()}
        _close(r["clipped_sum"], expected)
        moved = math.sqrt(sum(float((r["clipped_sum"][n] - r["clipped_sum_without"][n]).double().pow(2).sum())
                              for n in r["clipped_sum"]))
        assert 0 < moved <= C * (1 + 1e-6), moved
        assert r["isolation"] <= 1e-6 and r["victim_moved"] > 1e-3, (rank, r["isolation"], r["victim_moved"])


@pytest.mark.parametrize("ghost", [True, False])
def test_a_batch_that_drew_no_unit_runs_and_adds_nothing(setup, ghost):
    """A logical batch that drew no unit is one physical batch of padding, run like any other: every
    per-unit op takes a batch without a unit (it crashed the per-unit products' norms once)."""
    from longshield_fx.packing import empty_batch

    lm, engine = setup
    if not ghost:
        engine = lf.compile(lf.PackedCausalLMLoss(lm), config=engine.config, packed_units=U,
                            disable_passes=("ghost_norm",))
    engine._accum = None
    loss = engine.accumulate(*empty_batch(ROWS, T, U).tensors())
    assert float(loss) == 0 and bool((engine.last_norms == 0).all())
    assert all(bool((s == 0).all()) for s in engine._accum.values())
    engine._accum = None


def test_a_logical_batch_ending_in_batches_of_fewer_rows_clips_each_unit_as_alone(setup):
    """``pack_documents`` ends a logical batch in batches of half as many rows: 11 units in
    batches of 4, 4 and 2 rows. The engine captures each row count's graph once, and the
    clipped sum over all three batches equals the units alone, each clipped."""
    lm, engine = setup
    engine = lf.compile(lf.PackedCausalLMLoss(lm), config=engine.config, packed_units=U)
    units = _units(seed=1) + _units(seed=2)[:3]
    batches, _ = pack_documents(units, seq_len=T, rows=ROWS, unit_slots=U)
    assert [pb.units.shape[0] for pb in batches] == [ROWS, ROWS, ROWS // 2]
    expected = None
    for unit in units:
        g = _alone(lm, unit)
        norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in g.values()))
        factor = min(1.0, C / (norm + 1e-6))
        expected = {n: v * factor + (expected[n] if expected else 0) for n, v in g.items()}
    for step in range(2):
        lm.zero_grad()
        for pb in batches:
            engine.accumulate(*pb.tensors())
        engine.finalize(LogicalBatch(len(units), torch.arange(len(units)), [], 1.0, 1.0))
        _close({f"lm.{n}": p.grad for n, p in lm.named_parameters()}, expected)
        assert engine.captures == 2  # the 4-row graph and the 2-row one, at the first step


def test_a_model_change_inside_a_logical_batch_is_refused_whatever_rows_its_batches_have(setup):
    """A step runs one state of the model, in every row count's graph: a change after its first
    accumulate is refused at a batch of other rows, captured before or not yet, whether the
    fingerprint sees it (the training flag) or only dynamo's guards do (a global torch flag). A
    change between steps recaptures each row count's graph as its batches come, stale ones included."""
    lm, engine = setup
    units = _units(seed=1) + _units(seed=2)[:3]
    four, _, two = pack_documents(units, seq_len=T, rows=ROWS, unit_slots=U)[0]
    (eight,), _ = pack_documents(_units(seed=1), seq_len=T, rows=2 * ROWS, unit_slots=U)
    deterministic = torch.are_deterministic_algorithms_enabled()
    changes = {"fingerprint": (lambda: lm.eval(), lambda: lm.train()),
               "guard": (lambda: torch.use_deterministic_algorithms(not deterministic),
                         lambda: torch.use_deterministic_algorithms(deterministic))}
    try:
        for change, undo in changes.values():
            for other in (two, eight):  # a row count captured before, one never run
                engine.accumulate(*two.tensors())
                engine._accum, engine._accumulated = None, 0
                engine.accumulate(*four.tensors())
                change()
                try:
                    with pytest.raises(ValueError, match="changed since this logical batch's first accumulate"):
                        engine.accumulate(*other.tensors())
                finally:
                    undo()
                    engine._accum, engine._accumulated = None, 0
        for change, undo in changes.values():  # between steps: every graph is now stale
            change()
            try:
                captures = engine.captures
                engine.accumulate(*two.tensors())
                engine.accumulate(*four.tensors())  # stale since before this step: recaptured, not refused
                assert engine.captures == captures + 2
            finally:
                undo()
                engine._accum, engine._accumulated = None, 0
    finally:
        torch.use_deterministic_algorithms(deterministic)
        lm.train()
