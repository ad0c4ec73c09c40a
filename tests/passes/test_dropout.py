"""Dropout in training mode: the model's own random masks, per sample, kept (not redrawn)
under activation checkpointing."""
import collections

import pytest
import torch
import transformers

import longshield_fx as lf

from longshield_fx.runtime import traces
from oracles import token_batch


def gpt2_with_dropout(p=0.2):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=p,
                                  embd_pdrop=p, attn_pdrop=p, bos_token_id=None, eos_token_id=None,
                                  attn_implementation="sdpa")
    return lf.CausalLMLoss(transformers.GPT2LMHeadModel(cfg)).train()


def same_masks_oracle(model, batch, seed):
    """One eager forward of the whole batch from ``seed`` (so the same masks as ours), then one
    backward per sample: sample b's gradient is d loss_b / d params under those masks."""
    torch.manual_seed(seed)
    losses = model(*batch)
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    rows = [torch.autograd.grad(losses[b], params, retain_graph=True) for b in range(len(losses))]
    return {n: torch.stack([row[i] for row in rows]) for i, n in enumerate(names)}


@pytest.fixture(scope="module")
def model():
    return gpt2_with_dropout()


@pytest.fixture(scope="module")
def batch():
    return token_batch(B=3, T=16, vocab=128)


def per_sample(model, batch, seed, checkpoint=None):
    engine = lf.compile(model, checkpoint=checkpoint)
    engine.lower(*batch, graph="per_sample")  # capture draws nothing from the generator
    torch.manual_seed(seed)
    return engine.per_sample_grads(*batch)


def test_dropout_masks_are_the_models_and_per_sample_grads_are_exact(model, batch):
    ours = per_sample(model, batch, seed=3)
    ref = same_masks_oracle(model, batch, seed=3)
    for n in ref:
        torch.testing.assert_close(ours[n], ref[n], atol=1e-6, rtol=1e-5, msg=n)
    other_seed = per_sample(model, batch, seed=4)
    assert not torch.allclose(other_seed["lm.transformer.h.0.mlp.c_fc.weight"],
                              ours["lm.transformer.h.0.mlp.c_fc.weight"])  # the masks are random


@pytest.mark.parametrize("policy", ["block", "selective"])
def test_checkpointing_keeps_the_forward_masks(model, batch, policy):
    plain = per_sample(model, batch, seed=5)
    checkpointed = per_sample(model, batch, seed=5, checkpoint=policy)
    for n in plain:
        torch.testing.assert_close(checkpointed[n], plain[n], atol=1e-6, rtol=0, msg=n)
    graph = lf.compile(model, checkpoint=policy).lower(*batch, graph="per_sample").gm.graph
    dropouts = [n for n in graph.nodes if n.target == torch.ops.aten.native_dropout.default]
    assert dropouts and not any(n.meta.get("recomputed") for n in dropouts)


# --- attention dropout under context parallelism: refused ------------------------------------------

def test_attention_dropout_on_the_cpu_is_refused_under_context_parallelism(fake_world, batch):
    """Train mode with attention dropout > 0: on the CPU, SDPA then runs as math attention
    (softmax and dropout in the graph), which the ring cannot split: refused at the layer,
    naming the dropout (not the hand-written-attention advice: the model already uses SDPA)."""
    with fake_world(2) as mesh:
        engine = lf.compile(gpt2_with_dropout(p=0.2), mesh, config=lf.DPConfig(1.0, 1.0))
        with pytest.raises(lf.UnsupportedModelError,
                           match=r"^context_parallel: attention dropout .* in lm\.transformer\.h\.0\.attn .*set it to 0"):
            engine.lower(*batch)


def test_fused_attention_with_dropout_is_refused_under_context_parallelism(monkeypatch, fake_world):
    """A fused attention kernel that drops (the CUDA kernels take dropout_p in train mode; here
    the CPU flash nodes of a capture are given dropout_p = 0.1) is refused by name, with the fix."""
    import longshield_fx.runtime.engine as engine_module
    from oracles import tiny_llama

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    real_capture = engine_module.capture
    dropping = []

    def capture_with_attention_dropout(*args, **kwargs):
        captured = real_capture(*args, **kwargs)
        for node in captured.gm.graph.find_nodes(op="call_function", target=flash):
            if len(node.args) > 3:
                node.update_arg(3, 0.1)
            else:
                node.update_kwarg("dropout_p", 0.1)
            dropping.append(node.name)
        return captured

    monkeypatch.setattr(engine_module, "capture", capture_with_attention_dropout)
    monkeypatch.setattr(traces, "_TRACES", collections.OrderedDict())  # traces of this capture stay here
    ids = torch.zeros(2, 16, dtype=torch.long)
    with fake_world(2) as mesh:
        engine = lf.compile(tiny_llama(), mesh, config=lf.DPConfig(1.0, 1.0))
        with pytest.raises(lf.UnsupportedModelError,
                           match=r"^context_parallel: attention dropout at \S+ in lm\.layers\.0\.\S* .*is not "
                                 r"supported; set it to 0$"):
            engine.lower(ids, ids)
    assert len(dropping) == 2  # both layers' attention, before the passes ran
