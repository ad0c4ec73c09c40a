"""longshield::lm_head_loss's packed forms against each other: the rows form (the logits'
gradient, a row per position) gives the same losses, hidden-state gradient and per-unit head
gradients as the per-slot sums, and head_weight_grad the summed weight gradient."""
import pytest
import torch

from longshield_fx.ops.lm_head_loss import head_weight_grad, lm_head_loss
from longshield_fx.ops.segment import segment_outer

B, T, d, V, U = 3, 10, 8, 16, 5


def _inputs(dtype=torch.float32, runs=False):
    """``runs``: each unit's positions one run, read row after row (a unit continued across a
    row end), as packing lays them out; ``"whole rows"``: each row one unit (a long document's
    whole rows), so that a chunk's runs are of one length with consecutive slots (one batched
    product); ``"whole rows, slots out of order"``: the same, slots 2, 0, 1 (a product per run);
    else each position's unit drawn at random."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, T, d, generator=g).to(dtype)
    w = torch.randn(V, d, generator=g).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 7:] = -100  # padding: slot U, no loss
    labels[1, 2] = -100
    grad = torch.rand(B, T, generator=g)
    units = torch.randint(0, U, (B, T), generator=g)
    if runs in ("whole rows", "whole rows, slots out of order"):
        slots = torch.arange(B) if runs == "whole rows" else torch.tensor([2, 0, 1])
        return h, w, labels, grad, slots[:, None].expand(B, T).contiguous()
    if runs:
        units = (torch.arange(B * T) // 7).clamp(max=U - 1).view(B, T)
    units[0, 7:] = U
    return h, w, labels, grad, units


@pytest.mark.parametrize("runs", [False, True, "whole rows", "whole rows, slots out of order"])
@pytest.mark.parametrize("chunk", [3, 10])
def test_rows_equal_the_per_slot_sums(chunk, runs):
    h, w, labels, grad, units = _inputs(runs=runs)
    loss, grad_h, per_slot = lm_head_loss(h, w, labels, grad, chunk, -100, torch.float32, True, units, U + 1)
    loss_r, grad_h_r, rows = lm_head_loss(h, w, labels, grad, chunk, -100, torch.float32, True, None, 0, True)
    assert torch.equal(loss_r, loss) and torch.equal(grad_h_r, grad_h)  # the same chunks, the same formulas
    assert rows.shape == (B * T, V) and rows.dtype == h.dtype
    unit = units.reshape(-1)
    counts = torch.bincount(unit, minlength=U + 1)
    torch.testing.assert_close(segment_outer(rows, h.reshape(-1, d), unit, counts), per_slot, rtol=1e-5, atol=1e-6)
    for s in range(U + 1):  # and each slot's sum of its positions' outer products, in float64
        mine = unit == s
        torch.testing.assert_close(per_slot[s].double(), rows[mine].double().t() @ h.reshape(-1, d)[mine].double(),
                                   rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head_weight_grad(rows, h.reshape(-1, d)), per_slot.sum(0), rtol=1e-5, atol=1e-5)
    # Each row is its position's logits' gradient: a position without a loss has a zero row.
    assert float(rows[1 * T + 2].abs().max()) == 0


def test_bfloat16_rows_are_the_gradient_the_matmuls_read():
    """In bf16 the rows are the logits' gradient cast to h's dtype (as the per-slot form casts it
    before its matmuls), so both forms hold the same products, summed in another order."""
    h, w, labels, grad, units = _inputs(torch.bfloat16)
    _, _, per_slot = lm_head_loss(h, w, labels, grad, 4, -100, torch.float32, True, units, U + 1)
    _, _, rows = lm_head_loss(h, w, labels, grad, 4, -100, torch.float32, True, None, 0, True)
    assert rows.dtype == torch.bfloat16
    unit = units.reshape(-1)
    counts = torch.bincount(unit, minlength=U + 1)
    ours = segment_outer(rows.float(), h.reshape(-1, d).float(), unit, counts)
    torch.testing.assert_close(ours, per_slot.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("packed", [False, True])
def test_a_float64_heads_per_sample_gradient_is_summed_in_float64(packed):
    """A float64 head (``compute_dtype=torch.float64``, float64 models): its per-sample (or
    per-slot) gradients are the float64 sums of their positions' products, as the unrewritten
    graph's float64 matmul gives them, not fp32 sums cast back."""
    h, w, labels, grad, units = (x.double() if x.is_floating_point() else x for x in _inputs(runs=True))
    _, _, per = lm_head_loss(h, w, labels, grad, 3, -100, torch.float64, True, *((units, U + 1) if packed else ()))
    _, _, rows = lm_head_loss(h, w, labels, grad, 3, -100, torch.float64, True, None, 0, True)
    assert per.dtype == torch.float64
    owner = units.reshape(-1) if packed else torch.arange(B).repeat_interleave(T)
    for s in range(per.shape[0]):
        mine = owner == s
        torch.testing.assert_close(per[s], rows[mine].t() @ h.reshape(-1, d)[mine], rtol=1e-12, atol=1e-12)


def test_fake_shapes_match():
    h, w, labels, grad, units = _inputs()
    torch.library.opcheck(lm_head_loss, (h, w, labels, grad, 4, -100, torch.float32, True, None, 0, True))
    torch.library.opcheck(lm_head_loss, (h, w, labels, grad, 4, -100, torch.float32, True, units, U + 1))
    torch.library.opcheck(head_weight_grad, (torch.randn(B * T, V), h.reshape(-1, d)))


def test_the_rows_form_needs_the_weight_gradient():
    h, w, labels, grad, units = _inputs()
    with pytest.raises(ValueError, match="needs weight_grad"):
        lm_head_loss(h, w, labels, grad, 4, -100, torch.float32, False, None, 0, True)
