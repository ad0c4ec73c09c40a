"""chunked_loss: the LM head's cross-entropy over T-chunks equals the plain graph, without its logits."""
import pytest
import torch
from expecttest import assert_expected_inline

import longshield_fx as lf

from oracles import hf_llama, logical, tiny_llama, token_batch

PLAIN = ("chunked_loss",)
LM_HEAD_LOSS = torch.ops.longshield.lm_head_loss.default


def hf_qwen2(seed=0):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=True, attn_implementation="sdpa")
    return lf.CausalLMLoss(transformers.Qwen2ForCausalLM(cfg))


MODELS = {
    "llama": tiny_llama,
    "llama_tied": lambda seed=0: tiny_llama(seed, tie_embeddings=True),
    "hf_llama": hf_llama,
    "hf_qwen2_tied": hf_qwen2,
}


def batch(kind):
    """(3, 16) ids = labels, with -100 over the end of sample 0 and in the middle of sample 1."""
    ids, labels = token_batch(vocab=128 if kind.startswith("hf") else 256)
    labels = labels.clone()
    labels[0, 9:] = -100
    labels[1, 3:6] = -100
    return ids, labels


def clipped_sums(model, data, engine):
    engine.accumulate(*data, mask=torch.tensor([1.0, 1.0, 0.0]))  # sample 2 is padding
    engine.finalize(logical(2))
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def assert_all_close(ours, ref):
    assert set(ours) == set(ref)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", MODELS)
def test_per_sample_grads_and_clipped_sums_equal_the_plain_graph(kind):
    model, data = MODELS[kind](), batch(kind)
    config = lf.DPConfig(0.5, 0.0, loss_chunk=7)  # 7 rows over B=3: 2 positions per chunk, 8 chunks
    chunked = lf.compile(model, config=config)
    plain = lf.compile(model, config=config, disable_passes=PLAIN)
    assert_all_close(chunked.per_sample_grads(*data), plain.per_sample_grads(*data))
    lowered = chunked.lower(*data)
    assert sum(n.target is LM_HEAD_LOSS for n in lowered.gm.graph.nodes) == 1
    assert_all_close(clipped_sums(model, data, chunked), clipped_sums(model, data, plain))
    assert float(chunked.accumulate(*data)) == pytest.approx(float(plain.accumulate(*data)), rel=1e-6)


@pytest.mark.parametrize("kind", ["llama_tied", "hf_qwen2_tied"])
def test_with_block_checkpointing_equals_the_plain_graph(kind):
    model, data = MODELS[kind](), batch(kind)
    config = lf.DPConfig(0.5, 0.0, loss_chunk=7)
    chunked = lf.compile(model, config=config, checkpoint="block")
    plain = lf.compile(model, config=config, disable_passes=PLAIN)
    assert chunked.lower(*data).passes[-1] == "checkpoint"
    assert_all_close(clipped_sums(model, data, chunked), clipped_sums(model, data, plain))


def test_no_logits_are_materialised(tiny_per_sample):
    """The pass swaps the log-softmax, the NLL and their backward for one op; no tensor in the
    graph has a (T, V) slice any more (V = 256, T = 16, B = 3)."""
    lowered = tiny_per_sample.lowered
    record = next(r for r in lowered.log if r.name == "chunked_loss")
    assert_expected_inline(f"+ {sorted(record.added.items())}\n- {sorted(record.removed.items())}", """\
+ [('<built-in function getitem>', 1), ('aten.arange.default', 1), ('aten.full.default', 1), ('aten.index.Tensor', 1), ('aten.index_put.default', 2), ('aten.permute.default', 1), ('aten.reshape.default', 5), ('aten.squeeze.dim', 1), ('aten.sum.dim_IntList', 1), ('aten.view.default', 3), ('aten.zeros.default', 1), ('longshield.lm_head_loss.default', 1)]
- [('aten._log_softmax.default', 1), ('aten._log_softmax_backward_data.default', 1), ('aten._unsafe_view.default', 1), ('aten.detach.default', 2), ('aten.mm.default', 3), ('aten.nll_loss2d_backward.default', 1), ('aten.nll_loss2d_forward.default', 1), ('aten.slice_backward.default', 1), ('aten.t.default', 1), ('aten.transpose.int', 2)]""")
    op = next(n for n in lowered.gm.graph.nodes if n.target is LM_HEAD_LOSS)
    assert [tuple(a.meta["val"].shape) for a in op.args[:4]] == [(3, 16, 64), (256, 64), (3, 16), (3, 16)]
    assert [tuple(v.shape) for v in op.meta["val"]] == [(3, 16), (3, 16, 64), (3, 256, 64)]
    for node in lowered.gm.graph.nodes:
        shape = tuple(getattr(node.meta.get("val"), "shape", ()))
        assert not (len(shape) >= 2 and 256 in shape and (16 in shape or 15 in shape or 48 in shape)), node


def test_a_loss_it_does_not_know_is_left_as_it_is():
    """Softcapped logits (Gemma-2 style): not the pattern, so the plain graph runs unchanged."""

    class Softcapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = tiny_llama().lm

        def forward(self, ids, labels):
            logits = 30.0 * torch.tanh(self.lm(ids) / 30.0)
            return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(1)

    ids, labels = token_batch()
    engine = lf.compile(Softcapped())
    lowered = engine.lower(ids, labels, graph="per_sample")
    assert not any(n.target is LM_HEAD_LOSS for n in lowered.gm.graph.nodes)
    assert any(n.target is torch.ops.aten._log_softmax.default for n in lowered.gm.graph.nodes)


def test_loss_chunk_is_checked():
    with pytest.raises(ValueError, match="loss_chunk must be an int >= 1"):
        lf.DPConfig(1.0, 1.0, loss_chunk=0)


def test_the_head_names_its_rule(tiny_per_sample):
    assert tiny_per_sample.lowered.rules["lm.lm_head.weight"] == "lm_head_loss"


def test_a_frozen_head_gets_no_per_sample_gradient():
    """LoRA and other fine-tunes freeze the head: the op then skips its (B, V, d) gradient."""
    model, data = tiny_llama(), batch("llama")
    model.lm.lm_head.weight.requires_grad_(False)
    chunked, plain = lf.compile(model), lf.compile(model, disable_passes=PLAIN)
    assert_all_close(chunked.per_sample_grads(*data), plain.per_sample_grads(*data))
    op = next(n for n in chunked.lower(*data, graph="per_sample").gm.graph.nodes if n.target is LM_HEAD_LOSS)
    assert tuple(op.meta["val"][2].shape) == (3, 0, 64)


def test_a_packed_head_on_other_rows_than_the_batchs_positions_is_refused_by_name():
    """A packed model whose head reads h[:, :-1] (T - 1 rows a sample, not the batch's positions
    that ``units`` names): the pass leaves it as it is, and the per-unit rule's absence is the
    error, with its way out, as without the pass."""

    class Shifted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32, bias=False)

        def forward(self, ids, labels, positions, units):
            logits = self.head(torch.tanh(self.emb(ids))[:, :-1])
            return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], reduction="none").sum(1)

    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    units = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 2, 2, 2, 3, 3, 3]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [5, 6, 0, 1, 2, 0, 1, 2]])
    for passes in ((), PLAIN):
        engine = lf.compile(Shifted(), config=lf.DPConfig(0.5, 0.0), packed_units=3, disable_passes=passes)
        with pytest.raises(lf.UnsupportedModelError, match="head.weight.*Way out"):
            engine.per_sample_grads(ids, ids, positions, units)


@pytest.mark.parametrize("kind", ["ref", "gpt2"])
def test_packed_documents_head_gradients_are_per_unit_and_equal_each_unit_alone(kind):
    """Packed rows: chunks of 3 positions per row cut through units and hold several; units span
    rows. The reference Llama's head (U = 8 slots, N = 64 positions, V = 64, d = 32: N·(V+d) <
    (U+1)·V·d) gets the rows form, the logits' gradient (N, V) as token rows; GPT-2's, tied to
    the embedding, the op's per-slot sums (U+1, V, d). Per-unit gradients equal the plain
    graph's and each unit run alone, and the graph has no log-softmax of whole rows left."""
    from longshield_fx.packing import pack_documents
    from oracles import PACKED_ROWS, PACKED_T, PACKED_U, packed_alone, packed_model, packed_units

    loss, units = packed_model(kind), packed_units()
    config = lf.DPConfig(0.5, 0.0, loss_chunk=3 * PACKED_ROWS)
    chunked = lf.compile(loss, config=config, packed_units=PACKED_U)
    plain = lf.compile(loss, config=config, packed_units=PACKED_U, disable_passes=PLAIN)
    batch = pack_documents(units, seq_len=PACKED_T, rows=PACKED_ROWS, unit_slots=PACKED_U)[0][0]
    ours = chunked.per_sample_grads(*batch.tensors())
    assert_all_close(ours, plain.per_sample_grads(*batch.tensors()))
    for slot, unit in enumerate(batch.members):
        alone = packed_alone(loss.lm, units[unit])
        for name in alone:
            torch.testing.assert_close(ours[name][slot], alone[name], rtol=1e-5, atol=1e-6, msg=name)
    lowered = chunked.lower(*batch.tensors(), graph="per_sample")
    assert any("lm_head_loss" in rule for rule in lowered.rules.values())
    op = next(n for n in lowered.gm.graph.nodes if n.target is LM_HEAD_LOSS)
    V = loss.lm.get_output_embeddings().weight.shape[0] if kind != "ref" else loss.lm.cfg.vocab_size
    rows = (PACKED_ROWS * PACKED_T, V)
    assert tuple(op.meta["val"][2].shape)[:2] == (rows if kind == "ref" else (PACKED_U + 1, V))
    assert not any(n.target is torch.ops.aten._log_softmax.default for n in lowered.gm.graph.nodes)


@pytest.mark.parametrize("slots", [8, 1])
def test_packed_head_form_follows_the_cost_rule(slots):
    """N·(V+d) < (U+1)·V·d (N = 64 positions, V = 64, d = 32: U ≥ 3): the op returns the logits'
    gradient as token rows, the head is a packed linear weight for ``ghost_norm`` and ``clip``
    (ghost here), and the training graph holds no (U+1, V, d) tensor; below, the op's per-slot
    sums and the head's per-unit gradient as they are (``per-sample``)."""
    from longshield_fx.packing import pack_documents
    from oracles import PACKED_ROWS, PACKED_T, packed_model, packed_units

    loss = packed_model("ref")
    V, d = loss.lm.cfg.vocab_size, loss.lm.cfg.dim
    engine = lf.compile(loss, config=lf.DPConfig(0.5, 1.0, loss_chunk=3 * PACKED_ROWS), packed_units=slots)
    batch = pack_documents(packed_units(), seq_len=PACKED_T, rows=PACKED_ROWS, unit_slots=slots)[0][0]
    lowered = engine.lower(*batch.tensors())
    method = lowered.norm_methods["lm.lm_head.weight"]
    op = next(n for n in lowered.gm.graph.nodes if n.target is LM_HEAD_LOSS)
    dense = [n.name for n in lowered.gm.graph.nodes
             if tuple(getattr(n.meta.get("val"), "shape", ())) == (slots + 1, V, d)]
    if slots == 8:
        assert method.startswith("ghost") and not dense, (method, dense)
        assert tuple(op.meta["val"][2].shape) == (PACKED_ROWS * PACKED_T, V)
    else:
        assert method.startswith("per-sample") and dense, method
        assert tuple(op.meta["val"][2].shape) == (slots + 1, V, d)
