"""PoissonBatches: true Poisson sampling, fixed physical shapes, exact resume."""

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from longshield_fx.data import LogicalBatch, PoissonBatches
from longshield_fx.runtime.noise import InsecureSeedWarning

pytestmark = pytest.mark.filterwarnings("ignore::longshield_fx.runtime.noise.InsecureSeedWarning")


def _tokens(n, t=4):
    # Row i is filled with i + 1, so rows are distinguishable and row 0 is not zeros.
    return (torch.arange(n).unsqueeze(1) + 1).repeat(1, t)


def _rows(dataset, indices):
    """Expected per-field rows, for any supported dataset kind."""
    if isinstance(dataset, torch.Tensor):
        return (dataset[indices],)
    if isinstance(dataset, TensorDataset):
        return tuple(t[indices] for t in dataset.tensors)
    if indices.numel() == 0:
        return tuple(r[:0] for r in _rows(dataset, torch.tensor([0])))
    items = [dataset[i] for i in indices.tolist()]
    if isinstance(items[0], torch.Tensor):
        return (torch.stack(items),)
    return tuple(torch.stack(col) for col in zip(*items))


def _check_batch(batch: LogicalBatch, dataset, n, p):
    assert isinstance(batch, LogicalBatch)
    idx = batch.indices
    assert idx.dtype == torch.long and idx.numel() == batch.size
    assert bool((idx[1:] > idx[:-1]).all()) and (batch.size == 0 or 0 <= idx[0] <= idx[-1] < n)
    assert len(batch.physical) == max(1, math.ceil(batch.size / p))
    masks = torch.cat([m for _, m in batch.physical])
    assert masks.dtype == torch.float32
    assert torch.equal(masks, (torch.arange(masks.numel()) < batch.size).float())
    assert masks.sum().item() == batch.size
    row0 = _rows(dataset, torch.tensor([0]))
    for k, (tensors, mask) in enumerate(batch.physical):
        assert mask.shape == (p,)
        assert len(tensors) == len(row0)
        real = int(mask.sum().item())
        want = _rows(dataset, idx[k * p : k * p + real])
        for field, ref, first in zip(tensors, want, row0):
            assert field.shape == (p,) + first.shape[1:]
            assert torch.equal(field[:real], ref)
            assert torch.equal(field[real:], first.expand(p - real, *first.shape[1:]))


def _datasets(n):
    x = _tokens(n)
    y = torch.arange(n) * 10
    return {
        "tensor": x,
        "tensor_dataset": TensorDataset(x, y),
        "list_of_tuples": [(x[i], y[i]) for i in range(n)],
        "list_of_tensors": [x[i] for i in range(n)],
    }


@pytest.mark.parametrize("kind", ["tensor", "tensor_dataset", "list_of_tuples", "list_of_tensors"])
def test_dataset_kinds(kind):
    n, p = 23, 4
    dataset = _datasets(n)[kind]
    loader = PoissonBatches(dataset, 0.3, p, steps=20)
    for batch in loader:
        _check_batch(batch, dataset, n, p)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 60),
    q=st.floats(0.01, 1.0),
    p=st.integers(1, 17),
    seed=st.integers(0, 2**31),
)
def test_invariants_random_configs(n, q, p, seed):  # the seed keeps hypothesis' examples replayable
    """Fixed physical shapes, prefix masks summing to size, real rows then row-0 pads."""
    dataset = TensorDataset(_tokens(n), torch.arange(n))
    loader = PoissonBatches(dataset, q, p, insecure_seed=seed, steps=5)
    batches = list(loader)
    assert len(batches) == 5 == len(loader)
    for batch in batches:
        _check_batch(batch, dataset, n, p)


def test_empty_logical_batch_is_one_fully_masked_physical_batch():
    dataset = _tokens(3)
    loader = PoissonBatches(dataset, 0.01, 8, steps=50)
    empties = [b for b in loader if b.size == 0]
    assert empties, "q=0.01 with N=3 should give empty batches"
    for b in empties:
        assert len(b.physical) == 1
        (tensors,), mask = b.physical[0][0], b.physical[0][1]
        assert tensors.shape == (8, 4)
        assert torch.equal(mask, torch.zeros(8))


def test_full_sampling_rate_takes_everything():
    n = 10
    loader = PoissonBatches(_tokens(n), 1.0, 4)
    assert len(loader) == 1
    (batch,) = list(loader)
    assert batch.size == n and torch.equal(batch.indices, torch.arange(n))
    assert len(batch.physical) == 3


def test_mean_logical_batch_size_matches_binomial():
    n, q, steps = 100, 0.1, 2000
    loader = PoissonBatches(_tokens(n, 1), q, 16, steps=steps)
    assert loader.expected_batch_size == pytest.approx(q * n)
    total = sum(b.size for b in loader)
    # total ~ Binomial(n * steps, q)
    mean, sd = n * steps * q, math.sqrt(n * steps * q * (1 - q))
    assert abs(total - mean) < 5 * sd


def test_each_example_included_with_rate_q():
    n, q, steps = 50, 0.2, 1000
    loader = PoissonBatches(torch.arange(n), q, 8, steps=steps)
    counts = torch.zeros(n)
    for batch in loader:
        counts[batch.indices] += 1
    # each count ~ Binomial(steps, q); 5 sigma per example, 50 examples.
    sd = math.sqrt(steps * q * (1 - q))
    assert ((counts - steps * q).abs() < 5 * sd).all(), counts


def test_len_defaults_to_round_inverse_rate_and_epochs_repeat():
    assert len(PoissonBatches(_tokens(5), 0.3, 2)) == 3
    assert len(PoissonBatches(_tokens(5), 0.001, 2)) == 1000
    loader = PoissonBatches(_tokens(5), 0.5, 2, steps=4)
    assert len(list(loader)) == 4 and len(list(loader)) == 4
    assert loader.step == 8


def test_default_sampling_is_secret_and_insecure_seed_is_loud():
    def draws(**kw):
        return [b.indices.tolist() for b in PoissonBatches(_tokens(40), 0.3, 4, steps=10, **kw)]

    assert draws() != draws()  # a fresh OS key each time: nobody can replay who was sampled
    with pytest.warns(InsecureSeedWarning, match="sampling"):
        first = draws(insecure_seed=5)
    assert first == draws(insecure_seed=5) != draws(insecure_seed=6)


def test_inclusion_rate_is_exact_to_float64_at_tiny_q():
    for q in (1e-9, 1e-7, 0.3):
        loader = PoissonBatches(_tokens(3), q, 2)
        rate = loader._threshold / 2**53  # P(uniform53 < threshold)
        assert rate >= q and rate - q <= 2**-53


def test_inclusion_compares_53_bit_integers(monkeypatch):
    loader = PoissonBatches(_tokens(4), 1e-9, 4, steps=1)
    threshold = loader._threshold
    values = torch.tensor([threshold - 1, threshold, 0, 2**53 - 1])
    monkeypatch.setattr(loader._stream, "uniform53", lambda n, device="cpu": values[:n])
    (batch,) = list(loader)
    assert batch.indices.tolist() == [0, 2]
    assert batch.sample_rate == 1e-9 and batch.expected_size == pytest.approx(4e-9)


def _flatten(batches):
    return [
        (b.size, b.indices, [(tuple(t.clone() for t in ts), m) for ts, m in b.physical])
        for b in batches
    ]


def _assert_same(a, b):
    assert len(a) == len(b)
    for (sa, ia, pa), (sb, ib, pb) in zip(a, b):
        assert sa == sb and torch.equal(ia, ib) and len(pa) == len(pb)
        for (ta, ma), (tb, mb) in zip(pa, pb):
            assert torch.equal(ma, mb) and all(torch.equal(x, y) for x, y in zip(ta, tb))


@pytest.mark.parametrize("stop_after", [0, 3, 7, 9])
def test_resume_reproduces_uninterrupted_sequence(stop_after):
    n, q, p, steps = 40, 0.25, 6, 7
    dataset = TensorDataset(_tokens(n), torch.arange(n))
    reference = PoissonBatches(dataset, q, p, insecure_seed=3, steps=steps)
    uninterrupted = _flatten(list(reference) + list(reference))  # two epochs

    first = PoissonBatches(dataset, q, p, insecure_seed=3, steps=steps)
    seen = []
    it = iter(first)
    for _ in range(min(stop_after, steps)):
        seen.append(next(it))
    if stop_after > steps:  # stop in the second epoch
        seen += list(it)
        it = iter(first)
        for _ in range(stop_after - steps):
            seen.append(next(it))

    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state["step"] == stop_after

    resumed = PoissonBatches(dataset, q, p, steps=steps)  # its fresh key is replaced
    resumed.load_state_dict(state)
    rest = list(resumed)  # rest of the interrupted epoch
    if stop_after < steps:
        rest += list(resumed)
    _assert_same(_flatten(seen) + _flatten(rest), uninterrupted)


def test_load_state_dict_refuses_other_config():
    state = PoissonBatches(_tokens(10), 0.5, 2).state_dict()
    with pytest.raises(ValueError, match="sample_rate"):
        PoissonBatches(_tokens(10), 0.4, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="examples"):
        PoissonBatches(_tokens(11), 0.5, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="stream"):
        PoissonBatches(_tokens(10), 0.5, 2).load_state_dict({"step": 0})


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((_tokens(5), 0.0, 2), {}, r"sample_rate must be in \(0, 1\]"),
        ((_tokens(5), -0.1, 2), {}, r"sample_rate must be in \(0, 1\]"),
        ((_tokens(5), 1.5, 2), {}, r"sample_rate must be in \(0, 1\]"),
        ((_tokens(5), 0.5, 0), {}, r"physical_batch_size must be an integer >= 1"),
        ((_tokens(5), 0.5, 2.5), {}, r"physical_batch_size must be an integer >= 1"),
        ((_tokens(5), 0.5, 2), {"steps": 0}, r"steps must be an integer >= 1"),
        ((torch.zeros(0, 4), 0.5, 2), {}, r"dataset is empty"),
        (([], 0.5, 2), {}, r"dataset is empty"),
        ((TensorDataset(torch.zeros(0, 3)), 0.5, 2), {}, r"dataset is empty"),
        (([1, 2, 3], 0.5, 2), {}, r"dataset items must be tensors"),
    ],
)
def test_validation(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoissonBatches(*args, **kwargs)


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_every_data_parallel_group_gets_the_same_number_of_physical_batches(replicas):
    """Uneven Poisson draws (0, 1, odd, several batches): each group runs as many physical batches
    as every other (ZeRO-3 over dp shares collectives inside each), and every sampled row is in
    exactly one group's batches, real, once."""
    data = torch.arange(40).view(20, 2)
    for q in (0.02, 0.05, 0.2, 0.6, 1.0):
        sampler = PoissonBatches(data, sample_rate=q, physical_batch_size=2, insecure_seed=int(q * 100), steps=6)
        for logical in sampler:
            shares = [logical.share(rank, replicas) for rank in range(replicas)]
            assert len({len(s) for s in shares}) == 1 and len(shares[0]) >= 1
            real = []
            for share in shares:
                for (rows,), mask in share:
                    real += (rows[mask.bool(), 0] // 2).tolist()  # row i of the data holds (2i, 2i + 1)
            assert sorted(real) == logical.indices.tolist()
            assert sum(float(m.sum()) for s in shares for _, m in s) == logical.size
