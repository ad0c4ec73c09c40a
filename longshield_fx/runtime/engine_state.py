"""The engine's checkpoint state: the accountant's and the sampler's, and the engine's branch of
its run ledger. Never the model, the optimizer or the noise key: the noise key is drawn afresh
at every load (``CheckpointState.load_state_dict``)."""
from __future__ import annotations

import dataclasses
import os

from .noise import NoiseGenerator, broadcast_key, key_from_insecure_seed


@dataclasses.dataclass
class LedgerBranch:
    """This engine's branch of its run, for the run ledger (``run_core.RunLedger``)."""
    id: str
    recorded: int  # the last step of this branch a ledger holds (the loaded state's, at first)


def new_ledger_branch(steps: int) -> LedgerBranch:
    """A branch with a fresh id whose ledger holds the steps up to ``steps``."""
    return LedgerBranch(os.urandom(8).hex(), steps)


class CheckpointState:
    """``state_dict`` / ``load_state_dict`` of ``Engine``, and its noise generator, whose key every
    load replaces. A base of ``Engine``: these read and set its ``model``, ``config``,
    ``sharding``, ``accountant``, ``nonfinite_samples``, ``ledger_branch`` and accumulator."""

    def _new_noise(self, purpose: str) -> NoiseGenerator:
        """A noise generator with a fresh key: 256 bits from the OS, or (tests only) derived from
        ``insecure_seed`` and ``purpose``. A collective under torch.distributed.

        On the parameters' device, so the noise is drawn where the gradients are. Every rank
        holds rank 0's key. Unsharded, every rank draws the same noise, added once to the same
        full gradient; sharded, each shard draws from its own nonces (its stream), so every
        coordinate gets one draw and replicas of a shard the same one.
        """
        seed = self.config.insecure_seed
        key = None if seed is None else key_from_insecure_seed(seed, purpose)
        device = next(self.model.parameters()).device
        stream = self.sharding.index if self.sharding is not None else 0
        return NoiseGenerator(device, secure=self.config.secure_rng, key=broadcast_key(key), stream=stream)

    def state_dict(self, sampler=None) -> dict:
        """The accountant's state, and ``sampler``'s (a ``PoissonBatches``) if given; not the
        model or the optimizer, and not the noise key: an engine never saves or restores its
        noise stream (see ``load_state_dict``).

        SECRET: the sampling key tells who was sampled. Store checkpoints like the private data.
        """
        if self._accum is not None:
            raise RuntimeError("engine.state_dict: save between finalize and the next accumulate")
        state = {"accountant": self.accountant.state_dict(),
                 "nonfinite_samples": self.nonfinite_samples, "config": repr(self.config)}
        if sampler is not None:
            state["sampler"] = sampler.state_dict()
        return state

    def load_state_dict(self, state: dict, sampler=None, *, fork: bool = False,
                        released_elsewhere: list | None = None) -> None:
        """Restore a ``state_dict`` (and ``sampler``'s state, saved with it).

        The noise is never restored: every load gives the engine a fresh noise key (a collective
        under torch.distributed; every rank calls it). Restoring the stream would let two runs
        continued from one checkpoint draw the same noise, and the difference of their releases
        would then be the difference of their clipped gradients, noise-free. The sampling stream
        is restored, so a resumed run samples as the uninterrupted one would.

        A state with fewer accounted steps than this engine has already taken is refused
        unless ``fork=True``: loading it would forget privacy already spent. A fork keeps it:
        this engine's steps past the state stay accounted (``PrivacyAccountant.released_elsewhere``),
        and the fork's redraws of them count as the same subsampled batches released twice.
        ``released_elsewhere``: the run ledger's account of the other branches
        (``run_core.RunLedger.admit``), which replaces the state's own and this engine's."""
        if state.get("config") != repr(self.config):
            raise ValueError(f"engine.load_state_dict: checkpoint DP config {state.get('config')} differs "
                             f"from this engine's {self.config!r}")
        if (sampler is None) != ("sampler" not in state):
            raise ValueError("engine.load_state_dict: pass the sampler exactly when the state was saved with "
                             "one (engine.state_dict(sampler)); a resumed run must continue its sampling stream")
        saved_steps = sum(int(n) for _, _, n in state["accountant"]["history"])
        if saved_steps < self.accountant.steps and not fork:
            raise ValueError(f"engine.load_state_dict: the state is at step {saved_steps}, this engine already took "
                             f"step {self.accountant.steps}; loading it would under-report ε. Pass fork=True to "
                             "continue from it with both branches accounted")
        if released_elsewhere is None:
            released_elsewhere = [tuple(e) for e in state["accountant"].get("released_elsewhere", ())]
            if saved_steps < self.accountant.steps:  # this engine's own steps past the state: a second branch
                same_stream = sampler is None or sampler.state_dict()["stream"]["key"] == \
                    state["sampler"]["stream"]["key"]
                released_elsewhere += [(step if same_stream else None, s, q) for step, (s, q) in enumerate(
                    self.accountant.step_parameters(saved_steps + 1, self.accountant.steps), saved_steps + 1)]
                released_elsewhere += self.accountant.released_elsewhere
        if sampler is not None:
            sampler.load_state_dict(state["sampler"])
        self.accountant.load_state_dict(state["accountant"])
        self.accountant.released_elsewhere = released_elsewhere
        self.ledger_branch = new_ledger_branch(self.accountant.steps)
        self._noise = self._new_noise(f"noise after loading step {self.accountant.steps}")
        self.nonfinite_samples = int(state.get("nonfinite_samples", 0))
