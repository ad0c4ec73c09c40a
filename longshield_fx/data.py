"""Poisson-sampled logical batches cut into fixed-shape, masked physical batches.

Privacy accounting (``runtime/accounting.py``) assumes true Poisson sampling:
at every step each example joins the logical batch independently with
probability ``q``. Shuffling or fixed-size batches would make the reported
epsilon wrong (see ``shared/papers/dp-sgd-without-shortcuts.md`` §2.3), so
this module draws one Bernoulli per example per step and nothing else.

Logical batch sizes then vary from step to step, but the captured training
graph has a fixed batch dimension. Following masked DP-SGD (same paper, §3.1)
each logical batch is cut into physical batches of exactly
``physical_batch_size`` rows; the last one is padded, and a float mask marks
real rows with 1 and pads with 0 so that pads contribute nothing to per-sample
norms or clipped sums. The graph is never recaptured. (Packed batches,
``packing.PackedPoissonBatches``, have no mask and come in a fixed set of row
counts, one graph each: ``packing.row_counts``.)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from .runtime.noise import KeyStream, broadcast_key, key_from_insecure_seed

__all__ = ["LogicalBatch", "PoissonBatches"]


@dataclass
class LogicalBatch:
    """One Poisson-sampled logical batch.

    ``size`` is the number of real examples (may be 0). ``indices`` are their
    dataset indices in increasing order. ``physical`` is a non-empty list of
    ``(tensors, mask)`` pairs: ``tensors`` is a tuple with one tensor per
    dataset field (a 1-tuple for a plain-tensor dataset), each with leading
    dimension ``physical_batch_size``; ``mask`` is a float32 tensor of shape
    ``(physical_batch_size,)``. ``sum(mask.sum() for _, mask in physical) == size``.
    Packed batches (``packing.PackedPoissonBatches``) have no mask (None): their unit slots
    say which units they hold, and a logical batch's last ones have fewer rows.
    ``sample_rate`` and ``expected_size`` (q·N) are the sampler's: ``engine.finalize(batch)``
    divides by the expected size and accounts the step at this q, so q has one source.
    """

    size: int
    indices: torch.Tensor
    physical: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]
    sample_rate: float
    expected_size: float
    blank: tuple | None = None  # a physical batch of no sample (default: the first one, fully masked)

    def share(self, rank: int, replicas: int) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        """Replica ``rank``'s physical batches when ``replicas`` data-parallel groups split this
        logical batch: every ``replicas``-th one, padded with fully masked batches so that every
        group runs the same number, and the groups' i-th batches have the same number of rows
        (packed batches come in several: the batches of each row count are padded to a multiple
        of ``replicas``). Groups that share collectives inside each physical batch (ZeRO-3 over
        dp gathers parameters there) would otherwise wait on each other forever when the Poisson
        draw splits unevenly, or run graphs of different shapes side by side."""
        if replicas == 1:
            return list(self.physical)
        if self.blank is None and self.physical[0][1] is None:
            raise ValueError("LogicalBatch.share: packed batches (mask None) need blank=, a batch of no unit "
                             "(packing.empty_batch(rows, seq_len, unit_slots).tensors(), None), to even out the "
                             "groups: a copy of a real one would clip its units twice. PackedPoissonBatches sets it")
        blank = self.blank or (self.physical[0][0], torch.zeros_like(self.physical[0][1]))
        by_rows: dict[int, list] = {}
        for item in self.physical:
            by_rows.setdefault(item[0][0].shape[0], []).append(item)
        padded = []
        for rows in sorted(by_rows, reverse=True):
            # a blank's first rows are a blank of fewer rows (padding, or mask 0, in every row)
            fewer = (tuple(t[:rows] for t in blank[0]), None if blank[1] is None else blank[1][:rows])
            padded += by_rows[rows] + [fewer] * (-len(by_rows[rows]) % replicas)
        return padded[rank::replicas]


class PoissonBatches:
    """Iterable of Poisson-sampled :class:`LogicalBatch` es with fixed physical shapes.

    Args:
        dataset: a tensor whose first dimension indexes examples (e.g. token
            ids ``(N, T)``), a ``TensorDataset``, or any indexable sequence of
            tuples of fixed-shape tensors.
        sample_rate: q in (0, 1]; every example is included in every logical
            batch independently with this probability.
        physical_batch_size: rows per physical batch, >= 1.
        insecure_seed: TESTS ONLY. By default the inclusion draws come from a
            ChaCha20 stream keyed by 256 bits from the OS (``runtime/noise.py``;
            the accountant's amplification by sampling assumes nobody can tell
            who was sampled). A seed makes the batches reproducible by anyone who
            knows it, and warns. Its stream is never the noise's.
        steps: logical batches per epoch (``len(self)``); default
            ``round(1 / q)``, so that an epoch sees each example once in
            expectation. "Epoch" is only a loop boundary: steps are i.i.d.

    Padding: pad rows are copies of dataset row 0 (always a valid input, e.g.
    in-range token ids, so the padded forward pass cannot produce NaN/inf or
    index errors), and they carry mask 0.

    Empty logical batches (possible whenever ``q < 1``) yield ONE physical
    batch of pads with an all-zero mask rather than none. The step still runs
    the same compiled graph, its clipped sum is exactly zero, and the noise is
    added as on any other step, which is what the accountant assumes: skipping
    the step (or its noise) would release, without noise, whether the batch
    was empty.

    Under ``torch.distributed`` every rank must build the sampler at the same
    point: rank 0's key is broadcast, so all ranks draw the same logical batches.

    Inclusion is exact to float64: example i joins iff a 53-bit uniform integer is
    below ``ceil(q * 2**53)``, so the rate is q within 2**-53 (even at q = 1e-9).

    Iteration resumes where it left off: ``iter()`` yields the remaining steps
    of the current epoch (all ``len(self)`` at an epoch boundary). Together
    with :meth:`state_dict` / :meth:`load_state_dict` this makes a resumed run
    draw exactly the batches an uninterrupted run would have drawn.
    """

    def __init__(
        self,
        dataset: Any,
        sample_rate: float,
        physical_batch_size: int,
        *,
        insecure_seed: Optional[int] = None,
        steps: Optional[int] = None,
    ) -> None:
        if not _is_int(physical_batch_size) or physical_batch_size < 1:
            raise ValueError(
                f"physical_batch_size must be an integer >= 1, got {physical_batch_size!r}"
            )
        self._fields, self._single = _as_fields(dataset)
        self._dataset = dataset
        self._sampling(_length(dataset, self._fields), sample_rate, steps, insecure_seed)
        self.physical_batch_size = int(physical_batch_size)

    def _sampling(self, n: int, sample_rate: float, steps: Optional[int], insecure_seed: Optional[int]) -> None:
        """The Poisson draw over ``n`` examples: q, the epoch length and the secret stream."""
        if not (isinstance(sample_rate, numbers.Real) and 0.0 < sample_rate <= 1.0):
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        if steps is not None and (not _is_int(steps) or steps < 1):
            raise ValueError(f"steps must be an integer >= 1 or None, got {steps!r}")
        if insecure_seed is not None and not _is_int(insecure_seed):
            raise ValueError(f"insecure_seed must be an integer or None, got {insecure_seed!r}")
        self._n = n
        if self._n == 0:
            raise ValueError("dataset is empty: Poisson sampling needs at least one example")

        self.sample_rate = float(sample_rate)
        self._steps = int(steps) if steps is not None else max(1, round(1.0 / self.sample_rate))

        self._threshold = math.ceil(self.sample_rate * 2.0 ** 53)
        key = None if insecure_seed is None else key_from_insecure_seed(insecure_seed, "sampling")
        self._stream = KeyStream(broadcast_key(key))
        self._step = 0

    # -- sizes -----------------------------------------------------------------

    def __len__(self) -> int:
        """Logical batches (optimizer steps) per epoch."""
        return self._steps

    @property
    def num_examples(self) -> int:
        return self._n

    @property
    def expected_batch_size(self) -> float:
        """q * N: the divisor for the noisy gradient sum (DESIGN.md, DP semantics)."""
        return self.sample_rate * self._n

    @property
    def step(self) -> int:
        """Logical batches drawn so far, over all epochs."""
        return self._step

    # -- iteration -------------------------------------------------------------

    def __iter__(self) -> Iterator[LogicalBatch]:
        remaining = self._steps - self._step % self._steps
        for _ in range(remaining):
            yield self._next_batch()

    def _next_batch(self) -> LogicalBatch:
        include = self._stream.uniform53(self._n) < self._threshold
        indices = include.nonzero().squeeze(1)
        self._step += 1
        return LogicalBatch(size=int(indices.numel()), indices=indices, physical=self._physical(indices),
                            sample_rate=self.sample_rate, expected_size=self.expected_batch_size,
                            blank=self._blank())

    def _blank(self) -> tuple | None:
        """A physical batch of no sample, for ``LogicalBatch.share`` (None: a fully masked one)."""
        return None

    def _physical(self, indices: torch.Tensor) -> list:
        """The sampled examples as fixed-shape physical batches with their masks."""
        size = int(indices.numel())
        p = self.physical_batch_size
        num_physical = max(1, math.ceil(size / p))
        padded = torch.zeros(num_physical * p, dtype=torch.long)
        padded[:size] = indices
        mask = (torch.arange(num_physical * p) < size).to(torch.float32)

        physical = []
        for k in range(num_physical):
            rows = padded[k * p : (k + 1) * p]
            physical.append((self._gather(rows), mask[k * p : (k + 1) * p].clone()))
        return physical

    def _gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._fields is not None:
            return tuple(t[rows.to(t.device)] for t in self._fields)
        items = [self._dataset[i] for i in rows.tolist()]
        if self._single:
            return (torch.stack(items),)
        return tuple(torch.stack(column) for column in zip(*items))

    # -- checkpointing ---------------------------------------------------------

    def state_dict(self) -> dict:
        """Step counter and sampling stream (plus q and N, checked on load).

        SECRET: the stream's key tells who will be (and was) sampled.
        """
        return {
            "step": self._step,
            "stream": self._stream.state_dict(),
            "sample_rate": self.sample_rate,
            "num_examples": self._n,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the saved sampler stopped.

        Refuses a state saved with a different q or dataset size: it would
        silently change the sampling distribution the accountant assumes.
        """
        for key in ("step", "stream"):
            if key not in state:
                raise ValueError(
                    f"state is missing {key!r}; expected a PoissonBatches.state_dict()"
                )
        if state.get("sample_rate", self.sample_rate) != self.sample_rate:
            raise ValueError(
                f"state was saved with sample_rate={state['sample_rate']}, "
                f"this sampler has {self.sample_rate}"
            )
        if state.get("num_examples", self._n) != self._n:
            raise ValueError(
                f"state was saved for a dataset of {state['num_examples']} examples, "
                f"this one has {self._n}"
            )
        self._stream.load_state_dict(state["stream"])
        self._step = int(state["step"])


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _as_fields(dataset: Any) -> tuple[Optional[tuple[torch.Tensor, ...]], bool]:
    """Tensors to fancy-index directly (fast path), or None for a generic sequence.

    The bool says whether a generic dataset's items are single tensors.
    """
    if isinstance(dataset, torch.Tensor):
        if dataset.dim() == 0:
            raise ValueError("dataset tensor must have a leading example dimension")
        return (dataset,), True
    tensors = getattr(dataset, "tensors", None)  # torch.utils.data.TensorDataset
    if isinstance(tensors, tuple) and tensors and all(isinstance(t, torch.Tensor) for t in tensors):
        return tensors, False
    if len(dataset) == 0:
        return None, False
    first = dataset[0]
    if isinstance(first, torch.Tensor):
        return None, True
    if isinstance(first, Sequence) and first and all(isinstance(t, torch.Tensor) for t in first):
        return None, False
    raise ValueError(
        f"dataset items must be tensors or tuples of tensors, got {type(first).__name__}"
    )


def _length(dataset: Any, fields: Optional[tuple[torch.Tensor, ...]]) -> int:
    if fields is not None:
        return int(fields[0].shape[0])
    return len(dataset)
