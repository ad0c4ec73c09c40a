import pytest
import torch
import torch.nn.functional as F

import longshield_fx as lf
from longshield_fx.losses import CausalLMLoss

from oracles import assert_matches_vmap, hf_gpt2, hf_llama, tiny_llama


def reference(logits, labels):
    """Hand loop: per sample, summed cross-entropy of shifted logits/labels."""
    return torch.stack([
        F.cross_entropy(logits[i, :-1].float(), labels[i, 1:], reduction="sum", ignore_index=-100)
        for i in range(logits.shape[0])
    ])


def tiny_lm():
    """The bare tiny Llama (init seed 0), in eval mode."""
    return tiny_llama().lm.eval()


def test_matches_per_sample_loop():
    lm = tiny_lm()
    ids = torch.randint(0, 256, (3, 16))
    loss = CausalLMLoss(lm)(ids, ids)
    assert loss.shape == (3,) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference(lm(ids), ids))


def test_ignores_minus_100():
    lm = tiny_lm()
    ids = torch.randint(0, 256, (3, 16))
    labels = ids.clone()
    labels[0, 8:] = -100
    labels[2] = -100
    loss = CausalLMLoss(lm)(ids, labels)
    torch.testing.assert_close(loss, reference(lm(ids), labels))
    assert loss[2] == 0
    expected0 = F.cross_entropy(lm(ids)[0, :7], ids[0, 1:8], reduction="sum")
    torch.testing.assert_close(loss[0], expected0)


def test_sample_loss_depends_on_own_sample_only():
    loss_fn = CausalLMLoss(tiny_lm())
    ids = torch.randint(0, 256, (3, 16))
    other = ids.clone()
    other[1] = torch.randint(0, 256, (16,))
    a, b = loss_fn(ids, ids), loss_fn(other, other)
    torch.testing.assert_close(a[[0, 2]], b[[0, 2]])
    assert a[1] != b[1]


def test_parameter_names_and_position_ids():
    loss_fn = CausalLMLoss(tiny_lm())
    assert all(name.startswith("lm.") for name, _ in loss_fn.named_parameters())
    ids = torch.randint(0, 256, (2, 10))
    torch.testing.assert_close(loss_fn(ids, ids, position_ids=torch.arange(10)[None]), loss_fn(ids, ids))
    # RoPE is relative: shifting all positions changes nothing, stretching them does.
    torch.testing.assert_close(loss_fn(ids, ids, position_ids=torch.arange(10)[None] + 3), loss_fn(ids, ids))
    assert not torch.allclose(loss_fn(ids, ids, position_ids=torch.arange(10)[None] * 2), loss_fn(ids, ids))


def test_bf16_model_loss_in_fp32():
    lm = tiny_lm().to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 8))
    loss = CausalLMLoss(lm)(ids, ids)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference(lm(ids), ids))


@pytest.mark.parametrize("make", [hf_llama, hf_gpt2])
def test_hugging_face_models(make):
    lm = make().lm.eval()  # the tiny HF models of the other tests (vocab 128), unwrapped
    loss_fn = CausalLMLoss(lm)
    assert loss_fn.is_hf
    ids = torch.randint(0, 128, (2, 12))
    labels = ids.clone()
    labels[1, :5] = -100
    with torch.no_grad():
        logits = lm(ids, use_cache=False).logits
        torch.testing.assert_close(loss_fn(ids, labels), reference(logits, labels))
        pos = torch.arange(12)[None]
        torch.testing.assert_close(loss_fn(ids, labels, position_ids=pos), loss_fn(ids, labels))
        # Uneven positions stay one causal sequence (HF alone would split it at every jump).
        pos = torch.arange(12)[None] * 2
        whole = lm(ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False).logits
        split = lm(ids, position_ids=pos, use_cache=False).logits
        assert not torch.allclose(whole, split)
        torch.testing.assert_close(loss_fn(ids, labels, position_ids=pos), reference(whole, labels))


def test_a_sample_of_several_rows_sums_its_rows():
    """(B, R, T): sample i is R separate causal rows; its loss is the sum of its rows' losses,
    an all -100 row adds exactly 0, and the per-sample gradient covers the whole unit."""
    lm = tiny_lm()
    loss_fn = CausalLMLoss(lm)
    ids = torch.randint(0, 256, (3, 2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, 1] = -100  # sample 1 is one row long
    rows = loss_fn(ids.flatten(0, 1), labels.flatten(0, 1)).view(3, 2)
    units = loss_fn(ids, labels)
    torch.testing.assert_close(units, rows.sum(1))
    assert rows[1, 1] == 0
    ours = lf.compile(loss_fn).per_sample_grads(ids, labels)
    assert_matches_vmap(loss_fn, (ids, labels), ours=ours)
    per_row = lf.compile(loss_fn).per_sample_grads(ids.flatten(0, 1), labels.flatten(0, 1))
    for name, g in per_row.items():
        torch.testing.assert_close(ours[name], g.view(3, 2, *g.shape[1:]).sum(1), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"\(B, T\) or \(B, R, T\)"):
        loss_fn(ids, labels[:, 0])


def test_several_rows_under_block_checkpointing_equal_plain():
    loss_fn = CausalLMLoss(tiny_lm())
    ids = torch.randint(0, 256, (2, 3, 8), generator=torch.Generator().manual_seed(2))
    plain = lf.compile(loss_fn).per_sample_grads(ids, ids)
    block = lf.compile(loss_fn, checkpoint="block").per_sample_grads(ids, ids)
    for name in plain:
        torch.testing.assert_close(block[name], plain[name], atol=1e-6, rtol=1e-6)
