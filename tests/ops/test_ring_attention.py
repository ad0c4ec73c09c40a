"""Context-parallel ring attention (longshield_fx/ops/ring_attention.py, with ring_schedule.py,
document_attention.py and attention_kernels.py).

The multi-rank cases (cp=4 on 4 gloo ranks, cp=2 on two strided groups of them) run in the
4-rank launch of tests/runtime/cp_worker.py (the ``distributed`` fixture) and are checked
here; the oracle is full causal attention (``oracles.causal_attention``).
"""
from __future__ import annotations

import pytest
import torch

from longshield_fx import _torch
from longshield_fx.ops import attention_kernels as kernels
from longshield_fx.ops import document_attention as doc_attention
from longshield_fx.ops import ring_attention as ra
from longshield_fx.ops import ring_schedule as schedule

from oracles import attention_inputs, causal_attention, document_attention, packed_segments

B, HQ, HKV, T, D = 2, 4, 2, 32, 8
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(seed: int, T: int = T):
    return attention_inputs(seed, B, HQ, HKV, T, D)


# ----------------------------------------------------------------------------------------
# Layout


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_index_partitions_sequence(cp):
    idx = [schedule.zigzag_index(T, cp, r) for r in range(cp)]
    c = T // (2 * cp)
    assert all(i.dtype == torch.long and len(i) == T // cp for i in idx)
    assert torch.equal(torch.sort(torch.cat(idx)).values, torch.arange(T))
    assert idx[0][:c].tolist() == list(range(c))  # rank 0: first and last chunk
    assert idx[0][c:].tolist() == list(range(T - c, T))


@pytest.mark.parametrize("cp, dim", [(1, 1), (2, 1), (4, 2), (4, -2)])
def test_shard_unshard_round_trip(cp, dim):
    x = torch.randn(2, 3, T, 5) if dim in (2, -2) else torch.randn(2, T, 3)
    shards = [schedule.shard_sequence(x, cp, r, dim=dim) for r in range(cp)]
    assert all(s.shape[dim] == T // cp for s in shards)
    torch.testing.assert_close(schedule.unshard_sequence(shards, cp, dim=dim), x, atol=0, rtol=0)


def test_bad_length_raises():
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        schedule.zigzag_index(30, 4, 0)
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        schedule.shard_sequence(torch.randn(1, 12, 2), 4, 0)


# ----------------------------------------------------------------------------------------
# Schedule (pure): balanced, and covers exactly the causal lower triangle of chunk pairs


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_block_plan_balanced_and_exact(cp):
    counts = schedule.blocks_per_rank(cp)
    assert counts == [2 * cp + 1] * cp
    covered: dict[tuple[int, int], int] = {}
    for r in range(cp):
        for s in range(cp):
            src = (r - s) % cp
            qids, kids = (r, 2 * cp - 1 - r), (src, 2 * cp - 1 - src)
            for qs, ks, causal, n in schedule.block_plan(cp, r, src):
                qi = [0, 1] if qs == "all" else [qs]
                ki = [0, 1] if ks == "all" else [ks]
                pairs = [(qids[i], kids[j]) for i in qi for j in ki if kids[j] <= qids[i]]
                assert len(pairs) == n
                if not causal:  # a full block never contains a diagonal or skipped pair
                    assert all(kj < qi_ for qi_, kj in pairs) and len(pairs) == len(qi) * len(ki)
                for p in pairs:
                    covered[p] = covered.get(p, 0) + 1
    assert covered == {(i, j): 1 for i in range(2 * cp) for j in range(i + 1)}


# ----------------------------------------------------------------------------------------
# Single process (cp == 1): plain causal attention, no communication


def test_cp1_equals_causal_attention():
    q, k, v, grad = _inputs(0)
    ref_out, ref_lse, ref_grads = causal_attention(q, k, v, grad)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = torch.ops.longshield.ring_attention(qq, kk, vv, D**-0.5, "unused", 1)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (B, HQ, T)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    grads = torch.autograd.grad(out, (qq, kk, vv), grad)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL)
    assert grads[1].shape == (B, HKV, T, D)
    blocks = schedule.blocks_per_rank(1)[0]  # cp=1: the causal diagonal block of each of the two chunks + one full
    assert ra.last_block_counts == {"forward": blocks, "forward_calls": 1, "forward_skipped": 0,
                                    "backward": blocks, "backward_calls": 1, "backward_skipped": 0}


def _assert_one_rank_is_document_attention(q, k, v, grad, segments):
    """The op at cp = 1: out, lse, dq, dk and dv against ``oracles.document_attention``."""
    ref_out, ref_lse, ref_grads = document_attention(q, k, v, grad, segments)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = torch.ops.longshield.ring_attention(qq, kk, vv, D**-0.5, "unused", 1, 0, segments)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    for got, want in zip(torch.autograd.grad(out, (qq, kk, vv), grad), ref_grads):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("length", [T, 416])
def test_cp1_packed_documents_equal_document_attention(length):
    """One process: with ``segments`` each token attends causally within its document only;
    rows with documents of one token included (they skip the kernel); at 416 tokens runs longer
    than 64 too (padded to multiples of 16, not powers of two)."""
    q, k, v, grad = _inputs(4, length)
    segments = packed_segments(B, length, seed=2)
    segments[0, :3] = torch.tensor([-1, -2, -3])  # three one-token documents
    padded = {b.P for b in doc_attention._run_plan(segments, HQ, D).buckets}
    assert 1 in padded and (length == T or any(p > 64 and p % 16 == 0 and p & (p - 1) for p in padded)), padded
    _assert_one_rank_is_document_attention(q, k, v, grad, segments)
    with pytest.raises(ValueError, match="segments must be integer document ids of shape"):
        torch.ops.longshield.ring_attention(q, k, v, D**-0.5, "unused", 1, 0, segments[:, :-1])


def _each_run_alone(q, k, v, grad, segments):
    """out, dq, dk and dv of every document run as a sequence of its own, by causal SDPA and
    autograd (the floor the op is held to: each document alone)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    cu = doc_attention._document_runs(segments).tolist()
    L, rep = q.shape[2], q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for a, b in zip(cu[:-1], cu[1:]):
        row, at = divmod(a, L)
        run = [x[row:row + 1, :, at:at + b - a] for x in (q, k, v)]
        out[row:row + 1, :, at:at + b - a] = torch.nn.functional.scaled_dot_product_attention(
            run[0], *(x.repeat_interleave(rep, 1) for x in run[1:]), is_causal=True)
    return out.detach(), torch.autograd.grad(out, (q, k, v), grad)


def _assert_each_run_alone(q, k, v, grad, segments):
    """The op at cp = 1: out, dq, dk and dv as each run alone gives them (``_each_run_alone``),
    the gradients finite and within float rounding at the scores' magnitudes."""
    ref_out, ref_grads = _each_run_alone(q, k, v, grad, segments)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = torch.ops.longshield.ring_attention(qq, kk, vv, D**-0.5, "unused", 1, 0, segments)
    torch.testing.assert_close(out, ref_out, **TOL)
    for got, want in zip(torch.autograd.grad(out, (qq, kk, vv), grad), ref_grads):
        assert got.isfinite().all()
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max(), rtol=1e-5)


@pytest.mark.parametrize("hkv", [4, 1])
def test_cp1_packed_documents_with_large_scores_equal_each_run_alone(hkv):
    """Scores in the hundreds (q and k scaled up) and runs of every padded length: the padding of
    a bucket repeats its run's last token, so the backward's probabilities stay at most 1 and
    nothing overflows; out and gradients as each run alone gives them (to float rounding at these
    magnitudes), without GQA and with one K/V head (MQA) alike."""
    g = torch.Generator().manual_seed(7)
    q, grad = (torch.randn(3, 4, 160, D, generator=g) for _ in range(2))
    k, v = (torch.randn(3, hkv, 160, D, generator=g) for _ in range(2))
    q, k = q * 8, k * 8
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate([1, 2, 5, 17, 33, 70, 32] * 2 + [100, 1, 3, 55])])
    segments = torch.cat([segments, torch.arange(100, 100 + 480 - len(segments))]).view(3, 160)  # padding tokens
    assert len({b.P for b in doc_attention._run_plan(segments, 4, D).buckets}) > 3
    _assert_each_run_alone(q, k, v, grad, segments)


def test_run_plan_places_every_token_once():
    """The plan of a batch's runs: every token at exactly one unpadded place, which ``inverse``
    finds; a run's padding (after it) repeats its last token; a run is in a bucket at least as long
    as it, of a length the kernel runs well (``_fitted_length``)."""
    segments = packed_segments(3, 416, seed=5)
    segments[1, 7:10] = torch.tensor([-1, -2, -3])
    plan = doc_attention._run_plan(segments, HQ, D)
    cu = doc_attention._document_runs(segments).long()
    run_of = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    places = []
    for b in plan.buckets:
        index, valid = b.index.view(b.n, b.P), b.valid.view(b.n, b.P)
        first, last = index[:, 0], index[valid].view(-1).new_tensor([row[v].max() for row, v in zip(index, valid)])
        assert (run_of[first] == run_of[last]).all() and (cu[run_of[first]] == first).all()  # a whole run per row
        assert (cu[run_of[last] + 1] == last + 1).all()
        assert (index == torch.where(valid, index, last[:, None])).all()  # padding: the run's last token
        assert valid.all() if b.padding is None else (~valid).flatten().nonzero().squeeze(1).equal(b.padding)
        assert b.P == 1 or b.P >= doc_attention._fitted_length(int(valid.sum(1).max()), 416)
        places.append(index[valid])
    assert torch.cat(places).sort().values.equal(torch.arange(3 * 416))
    padded = torch.cat([b.index for b in plan.buckets])
    assert padded[plan.inverse].equal(torch.arange(3 * 416))  # each token's place holds it


def test_fitted_lengths_are_the_kernels_block_sizes():
    """Powers of two up to 16, then multiples of 16, of 32 above 256, of 64 above 512, never above
    the row."""
    fit = [doc_attention._fitted_length(n, 2048) for n in (1, 2, 3, 5, 16, 17, 33, 64, 65, 250, 257, 513, 2000)]
    assert fit == [1, 2, 4, 8, 16, 32, 48, 64, 80, 256, 288, 576, 2048]
    assert doc_attention._fitted_length(250, 250) == 250


@pytest.mark.parametrize("heads", [1, 4, 64])
def test_bucket_lengths_are_the_cheapest_split(heads):
    """The dynamic programme's buckets cost what the cheapest of every split of the sorted lengths
    into consecutive buckets costs (under ``_CALL_US`` and ``_sequence_us``): few heads merge
    lengths to save calls, many heads keep each length's own bucket."""
    fitted, counts = [2, 16, 48, 64, 96, 112, 224], [3, 1, 5, 1, 7, 1, 2]

    def cost(lengths):
        return sum(doc_attention._CALL_US * (i == len(lengths) - 1 or lengths[i] != lengths[i + 1])
                   + n * doc_attention._sequence_us(p, heads, D) for i, (n, p) in enumerate(zip(counts, lengths)))

    def splits(i):  # every split of fitted[i:] into consecutive buckets, as each length's bucket length
        if i == len(fitted):
            yield []
        for j in range(i, len(fitted)):
            for rest in splits(j + 1):
                yield [fitted[j]] * (j - i + 1) + rest

    chosen = doc_attention._bucket_lengths(fitted, counts, heads, D)
    assert cost(chosen) == pytest.approx(min(map(cost, splits(0))))
    assert chosen[-1] == 224 and chosen == sorted(chosen) and all(c >= f for c, f in zip(chosen, fitted))
    if heads == 1:  # calls dominate: the lone 16 and 64 join longer buckets
        assert chosen[1] > 16 and chosen[3] > 64
    if heads == 64:  # the kernel dominates: every length its own bucket
        assert chosen == fitted


def test_the_plan_is_made_once_per_batch():
    """Every layer's forward and backward of one batch share one plan; ids equal in value (another
    tensor) share it too, and ids changed in place, or other heads, get a new one."""
    q, k, v, grad = _inputs(6)
    segments = packed_segments(B, T, seed=4)
    first = doc_attention._run_plan(segments, HQ, D)
    qq = q.clone().requires_grad_()
    out, _ = torch.ops.longshield.ring_attention(qq, k, v, D**-0.5, "unused", 1, 0, segments)
    out.backward(grad)
    assert doc_attention._run_plan(segments, HQ, D) is first and doc_attention._run_plan(segments.clone(), HQ, D) is first
    assert doc_attention._run_plan(segments, HQ, 2 * D) is not first
    again = doc_attention._run_plan(segments, HQ, D)
    segments[0, 1] = -7  # a one-token document where there was none
    changed = doc_attention._run_plan(segments, HQ, D)
    assert changed is not again and any(b.P == 1 for b in changed.buckets)
    assert doc_attention._run_plan(torch.zeros(B, T, dtype=torch.long), HQ, D) is None  # every row one run: no plan


@pytest.mark.parametrize("rows", ["one document each", "one document and many"])
def test_cp1_rows_of_one_document_are_attended_as_they_are(rows):
    """Rows that are one document go to the kernel without being gathered into groups of runs;
    beside rows of many documents, which are."""
    q, k, v, grad = _inputs(5)
    segments = torch.arange(B)[:, None].expand(B, T).clone()
    if rows == "one document and many":
        segments[1] = packed_segments(B, T, seed=3)[1]
    _assert_one_rank_is_document_attention(q, k, v, grad, segments)
    # On Hopper the first go to cuDNN's causal kernel and the rest to flash over runs (gpu_check.py packed).
    whole, rest = doc_attention._rows_by_runs(segments)
    many = [] if rows == "one document each" else [1]
    assert whole.tolist() == [r for r in range(B) if r not in many] and rest.tolist() == many
    assert not kernels._cudnn(q.bfloat16())  # never on the CPU


def test_cp1_rows_mostly_of_one_document_each_go_to_the_kernel_whole_and_the_rest_run_by_run():
    """Three of four rows one document each (long documents): the kernel runs on every row as
    it lies and the fourth row, of many documents and padding, attended run by run, replaces
    what the kernel made of it. With scores in the hundreds the kernel's backward of that row,
    under its run-by-run lse, may overflow; none of it reaches the result, which is each run
    alone's, finite, for the rows of one document and the row of many alike."""
    g = torch.Generator().manual_seed(11)
    q, grad = (torch.randn(4, HQ, 96, D, generator=g) for _ in range(2))
    k, v = (torch.randn(4, HKV, 96, D, generator=g) for _ in range(2))
    q, k = q * 8, k * 8
    segments = torch.arange(4)[:, None].expand(4, 96).clone()
    segments[2] = torch.cat([torch.full((n,), 10 + i) for i, n in enumerate([1, 40, 3, 17, 30])] + [torch.arange(50, 55)])
    plan = doc_attention._run_plan(segments, HQ, D)
    assert plan.rest.tolist() == [2] and sum(b.n * b.P for b in plan.buckets) >= 96
    _assert_each_run_alone(q, k, v, grad, segments)
    _assert_one_rank_is_document_attention(q / 8, k / 8, v, grad, segments)  # and lse, at ordinary scores


def test_document_runs_cut_rows_where_the_attention_mask_does():
    """A whole row of packed documents (cp = 1) attends run by run: on the CPU in groups of runs
    of one padded length (``test_cp1_packed_documents_equal_document_attention``), on a GPU in
    half precision as flash attention over variable-length runs (its CUDA call is checked by
    ``benchmarks/gpu_check.py packed``). The runs: causal attention within each run, run by run,
    equals the document attention, including one-token documents and a document continued in
    the next row."""
    q, k, v, grad = _inputs(4)
    segments = packed_segments(B, T, seed=2)
    segments[0, :3] = torch.tensor([-1, -2, -3])
    segments[1, :5] = segments[0, -1]  # the same id at the next row's start: a run of its own
    cu = doc_attention._document_runs(segments)
    lengths = (cu[1:] - cu[:-1]).tolist()
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == B * T and doc_attention._longest(cu) == max(lengths)
    assert T in cu.tolist()  # every row starts a run
    flat = [doc_attention._tokens_major(kernels._expand_heads(x, HQ // x.shape[1])) for x in (q, k, v)]
    runs = [torch.nn.functional.scaled_dot_product_attention(
        *(x[a:b].transpose(0, 1) for x in flat), is_causal=True).transpose(0, 1)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    out = torch.cat(runs).view(B, T, HQ, D).transpose(1, 2)
    torch.testing.assert_close(out, document_attention(q, k, v, grad, segments)[0], **TOL)
    assert doc_attention._by_document_runs(q, segments) and not doc_attention._by_document_runs(q, None)


@pytest.mark.parametrize("rows", ["no documents", "one document each", "mostly one document each", "runs"])
def test_cp1_float64_equals_the_oracle_and_keeps_lse_in_float64(rows):
    """float64 inputs (``DPConfig(compute_dtype=torch.float64)``, float64 models): out, lse, dq,
    dk and dv against the float64 oracle on every path of the op at cp = 1, lse in float64 (the
    CPU kernel's backward takes it in its accumulation dtype)."""
    q, k, v, grad = (x.double() for x in _inputs(6))
    segments = {"no documents": None,
                "one document each": torch.arange(B)[:, None].expand(B, T).clone(),
                "mostly one document each": torch.cat([torch.arange(3)[:, None].expand(3, T),
                                                       packed_segments(1, T, seed=4) + 100]),
                "runs": packed_segments(B, T, seed=2)}[rows]
    if rows == "mostly one document each":
        q, k, v, grad = (torch.cat([x, x[:1], x[:1]])[:4] for x in (q, k, v, grad))
        assert doc_attention._run_plan(segments, HQ, D).rest.tolist() == [3]
    if rows == "runs":
        segments[0, :3] = torch.tensor([-1, -2, -3])  # one-token runs: the kernel-free bucket
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = torch.ops.longshield.ring_attention(qq, kk, vv, D**-0.5, "unused", 1, 0, segments)
    grads = torch.autograd.grad(out, (qq, kk, vv), grad)
    if segments is None:
        ref_out, ref_lse, ref_grads = causal_attention(q, k, v, grad)
    else:
        ref_out, ref_lse, ref_grads = document_attention(q, k, v, grad, segments)
    assert out.dtype == lse.dtype == torch.float64
    for got, want in zip((out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_cp1_opcheck():
    q, k, v, _ = _inputs(1, T=8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.longshield.ring_attention.default, (q, k, v, 0.3, "unused", 1))
    segments = packed_segments(B, 8, seed=1)
    segments[1, 0] = -1  # a one-token run: the kernel-free bucket
    for ids in (segments, torch.zeros_like(segments)):  # buckets of runs; every row one run
        torch.library.opcheck(torch.ops.longshield.ring_attention.default, (q, k, v, 0.3, "unused", 1, 0, ids))


# ----------------------------------------------------------------------------------------
# Multi-process (gloo)


@pytest.mark.torchrun(4)
@pytest.mark.parametrize("hkv", [2, 1])
@pytest.mark.parametrize("cp", [4, 2])
def test_ring_matches_full_attention(distributed, cp, hkv):
    """4 gloo ranks: cp=4 on the world group, then cp=2 on two strided groups (dp=2); 4 query
    heads on 2 KV heads and on 1 (MQA). Forward out/lse, backward dq/dk/dv (autograd through
    the op) vs full causal GQA attention (assert_close at TOL, run on each rank), and
    balanced block counts."""
    for rank, r in distributed.check(4, f"ring-cp{cp}-hkv{hkv}").items():
        assert r["shapes"] == r["expected_shapes"], rank
        for name in ("out", "lse", "dq", "dk", "dv"):
            assert r[name] is None, f"rank {rank}: {r[name]}"
        counts = r["counts"]  # every rank of this rank's group
        assert all(c == counts[0] for c in counts), (cp, counts)
        assert counts[0] == {"forward": r["expected_blocks"], "forward_calls": cp, "forward_skipped": 0,
                             "backward": r["expected_blocks"], "backward_calls": cp, "backward_skipped": 0}, (cp, counts)
        assert r["expected_blocks"] == schedule.blocks_per_rank(cp)[0]  # balanced: the same on every rank


@pytest.mark.torchrun(4)
@pytest.mark.parametrize("inner", [2, 1])
def test_double_ring_matches_full_attention(distributed, inner):
    """cp=4 as a double ring (LoongTrain Alg. 2): two inner rings of 2, or four of 1 (every
    hop on the outer ring). The same blocks meet the same queries: exact full attention and
    gradients, the single ring's block counts."""
    for rank, r in distributed.check(4, f"ring-cp4-w{inner}").items():
        for name in ("out", "lse", "dq", "dk", "dv"):
            assert r[name] is None, f"rank {rank}: {r[name]}"
        assert all(c == {"forward": r["expected_blocks"], "forward_calls": 4, "forward_skipped": 0,
                         "backward": r["expected_blocks"], "backward_calls": 4, "backward_skipped": 0}
                   for c in r["counts"]), r["counts"]


@pytest.mark.torchrun(4)
@pytest.mark.parametrize("cp, inner, dtype", [(4, 4, ""), (2, 2, ""), (4, 2, ""), (4, 2, "-float64")])
def test_packed_documents_ring_matches_document_attention(distributed, cp, inner, dtype):
    """Rows of packed documents (``segments``): every token attends causally within its own
    document, on a single ring (cp=4; cp=2 on strided groups) and a double ring, against
    ``document_attention`` (assert_close at TOL; float64 inputs, the double ring, at 1e-12 with
    lse and the accumulators in float64). Isolation: another document's q, k and v
    replaced leave every other token's out, lse, dq, dk and dv unchanged (≤ 1e-6), while the
    document's own output moves. A row whose chunk pairs in a call share no document is left out of
    it, in the forward and backward alike, and ``pairs_skipped`` (no process group) counts the same."""
    skipped = 0
    for rank, r in distributed.check(4, f"packed-ring-cp{cp}-w{inner}{dtype}").items():
        for name in ("out", "lse", "dq", "dk", "dv"):
            assert r[name] is None, f"rank {rank}: {r[name]}"
        assert r["isolation"] <= 1e-6 and r["document_changed"] > 0.1, (rank, r["isolation"], r["document_changed"])
        for c in r["counts"]:
            assert c["forward"] <= r["expected_blocks"], c
            assert (c["backward"], c["backward_skipped"]) == (c["forward"], c["forward_skipped"]), c
        skipped += r["counts"][0]["forward_skipped"]
        rows = r["segments"].shape[0]
        group = (sum(c["forward_skipped"] for c in r["counts"]), rows * sum(schedule.blocks_per_rank(cp)))
        assert schedule.pairs_skipped(r["segments"], cp) == group  # the count without a process group
    if cp == 4:  # documents of 1 to T/2 = 16 tokens in chunks of 4: some chunk pairs share none
        assert skipped > 0


@pytest.mark.parametrize("cp, inner", [(4, 2), (8, 2), (8, 4), (4, 1), (6, 3)])
def test_double_ring_visits_every_block_once(cp, inner):
    """Every rank meets every K/V block exactly once, and its peers are in its inner ring
    (same outer index) or the same position of the next/previous inner ring."""
    for rank in range(cp):
        rings = ra._Rings(None, rank, cp, inner)
        assert sorted(rings.source(o, i) for o in range(cp // inner) for i in range(inner)) == list(range(cp))
        assert all(p // inner == rank // inner for p in rings.inner_peers)
        assert all(p % inner == rank % inner for p in rings.outer_peers)


def test_inner_ring_must_divide_cp():
    q, k, v, _ = _inputs(1, T=8)
    with pytest.raises(ValueError, match="inner ring size 3 must divide cp=1"):
        torch.ops.longshield.ring_attention(q, k, v, 0.3, "unused", 1, 3)


# ----------------------------------------------------------------------------------------
# Export: each op stays a single opaque node in the joint graph (fake process group, fake kernels)

class _AttentionModule(torch.nn.Module):
    def __init__(self, group_name: str):
        super().__init__()
        self.group_name = group_name
        self.wq = torch.nn.Linear(8, 8, bias=False)
        self.wk = torch.nn.Linear(8, 4, bias=False)
        self.wv = torch.nn.Linear(8, 4, bias=False)

    def forward(self, x):
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, 2, 4).transpose(1, 2)
        k = self.wk(x).view(B, L, 1, 4).transpose(1, 2)
        v = self.wv(x).view(B, L, 1, 4).transpose(1, 2)
        out, lse = torch.ops.longshield.ring_attention(q, k, v, 0.5, self.group_name, 2)
        return out.sum((1, 2, 3))


def test_export_keeps_single_nodes(fake_world):
    """Each op stays one opaque node of the joint graph (fake process group, fake kernels only)."""
    ra.last_block_counts.clear()
    with fake_world(2) as mesh:
        name = mesh.get_group().group_name
        gm, _ = _torch.export_joint(_AttentionModule(name), (torch.randn(2, 16, 8),))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("longshield.ring_attention.default") == 1
    assert targets.count("longshield.ring_attention_backward.default") == 1
    assert not any("scaled_dot_product" in t for t in targets)
    bwd = next(n for n in gm.graph.nodes if n.target is torch.ops.longshield.ring_attention_backward.default)
    scale, group_name, cp = [a for a in bwd.args if not isinstance(a, torch.fx.Node)]  # inner: default
    assert scale == 0.5 and group_name == name and cp == 2
    assert list(bwd.meta["val"][1].shape) == [2, 1, 16, 4]  # dk: one KV head, not repeated
    assert ra.last_block_counts == {}  # only fake kernels ran
