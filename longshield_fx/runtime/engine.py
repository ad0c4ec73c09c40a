"""The engine: runs the compiled graph per physical batch, adds noise once per logical batch.

No hooks anywhere: the model is only read (parameters and buffers are passed to the graph
as inputs) and ``param.grad`` is written in ``finalize``.
"""
from __future__ import annotations

import copy
import os

import torch
from torch import nn

from ..capture import capture
from ..config import DPConfig
from ..errors import UnsupportedModelError
from ..passes import PassContext, format_log, run_passes
from ..passes._graph import val
from ..passes.batch_dims import batch_dims
from ..passes.checkpoint import checkpoint
from ..passes.clip import clip
from ..passes.per_sample import per_sample
from .accounting import PrivacyAccountant
from .parallel import Parallel


class Engine:
    """A compiled DP training step. Made by ``longshield_fx.compile``.

    Capture happens at the first call, with that batch's shapes; every later physical
    batch must have the same shapes (pad with a mask: ``longshield_fx.data.PoissonBatches``).
    """

    def __init__(self, model: nn.Module, config: DPConfig | None, mesh=None, checkpoint=None):
        self.model = model
        self.checkpoint = checkpoint
        self.config = config
        self.parallel = Parallel.from_mesh(model, mesh)
        self.accountant = PrivacyAccountant()
        self.captures = 0  # number of graph captures; stays 1 with fixed physical shapes
        self._train = None  # (CapturedGraph, GraphModule, PassContext)
        self._inspect = None
        self._shapes = None
        self._accum: dict[str, torch.Tensor] | None = None
        # On the parameters' device, so the noise is drawn where the gradients are.
        self._noise = torch.Generator(device=next(model.parameters(), torch.empty(0)).device)
        if config is not None:
            seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            # Every rank draws the same noise, added once to the same full gradient.
            self._noise.manual_seed(self.parallel.broadcast_seed(seed))

    # --- compilation ----------------------------------------------------------------------
    def _compile(self, batch, passes):
        self._check_shapes(batch)
        dtype = self.config.compute_dtype if self.config is not None else None
        model = self.parallel.capture_module(self.model)
        if dtype is not None and dtype != next(model.parameters()).dtype:
            model = copy.deepcopy(model).to(dtype)  # capture only; the live model keeps its dtype
        batch = self.parallel.shard(batch)
        captured = capture(model, batch)
        self.captures += 1
        B = batch[0].shape[0]
        loss_val = val(captured.gm.graph.output_node().args[0][0])
        if loss_val is None or tuple(loss_val.shape) != (B,):
            raise UnsupportedModelError(
                f"the model must return per-sample losses of shape ({B},), got "
                f"{None if loss_val is None else tuple(loss_val.shape)}; wrap a language model in "
                "longshield_fx.CausalLMLoss or return loss.sum(dim=1)-style per-sample values")
        ctx = PassContext(captured, B, self.config, cp_size=self.parallel.cp,
                          cp_group_name=self.parallel.cp_group_name, cp_rank=self.parallel.cp_rank,
                          checkpoint=self.checkpoint)
        passes = self.parallel.passes(passes) + ([checkpoint] if self.checkpoint else [])
        gm = run_passes(captured.gm, ctx, passes)
        if captured.mutations:
            raise UnsupportedModelError(
                f"the forward mutates model state ({', '.join(captured.mutations)}); the compiled step "
                "would drop those updates. Way out: keep buffers constant during the training step")
        return captured, gm, ctx

    def _check_shapes(self, batch):
        if not batch or not all(isinstance(t, torch.Tensor) for t in batch):
            raise TypeError("engine: pass the batch as tensors, e.g. engine.accumulate(input_ids, labels)")
        shapes = [(tuple(t.shape), t.dtype) for t in batch]
        B = batch[0].shape[0] if batch[0].dim() else None
        if B is None or any(t.dim() == 0 or t.shape[0] != B for t in batch):
            raise ValueError(f"engine: every batch tensor needs the batch as dimension 0, got shapes {[s for s, _ in shapes]}")
        self.parallel.check_batch(batch)
        if self._shapes is None:
            self._shapes = shapes
        elif shapes != self._shapes:
            raise ValueError(
                f"engine: physical batch shapes changed from {self._shapes} to {shapes}; the compiled "
                "graph has fixed shapes. Pad to a fixed physical batch and pass mask= "
                "(longshield_fx.data.PoissonBatches does this)")

    def _training_graph(self, batch):
        if self.config is None:
            raise ValueError("engine: training needs a DP config: longshield_fx.compile(model, config=DPConfig(...))")
        if self._train is None:
            self._train = self._compile(batch, [batch_dims, per_sample, clip])
        return self._train

    @property
    def graph_module(self):
        """The rewritten training graph (None before the first call)."""
        return None if self._train is None else self._train[1]

    def _dtype(self):
        return None if self.config is None else self.config.compute_dtype

    # --- training -------------------------------------------------------------------------
    def accumulate(self, *batch, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Forward, backward and clip one physical batch; add its clipped sum to the accumulator.

        ``mask`` (B,) of 0/1 marks padding rows (0), which contribute exactly nothing.
        Returns the summed loss of the real samples.
        """
        self._check_shapes(batch)
        B = batch[0].shape[0]
        if mask is None:
            mask = torch.ones(B)
        mask = torch.as_tensor(mask)
        if tuple(mask.shape) != (B,):
            raise ValueError(f"engine.accumulate: mask must have shape ({B},), got {tuple(mask.shape)}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("engine.accumulate: mask must hold only 0 (padding) and 1 (real sample)")
        captured, gm, _ = self._training_graph(batch)
        loss_val = val(captured.cotangent_placeholder())
        cotangent = mask.to(device=batch[0].device, dtype=loss_val.dtype)
        args = captured.gather_args(self.model, self.parallel.shard(batch), cotangent, dtype=self._dtype())
        with torch.no_grad(), self.parallel.collective_errors():
            loss_sum, norms, *sums = gm(*args)
            loss_sum = self.parallel.sum_over_cp(loss_sum)
        if self._accum is None:
            self._accum = {n: s.clone() for n, s in zip(captured.param_names, sums)}
        else:
            for n, s in zip(captured.param_names, sums):
                self._accum[n] += s
        self.last_norms = norms
        return loss_sum

    def finalize(self, expected_batch_size: float) -> None:
        """Add N(0, σ²C²) once per coordinate, divide by the EXPECTED batch size, write .grad.

        Then any torch optimizer can step. The accumulator is cleared, and one step is
        recorded with the privacy accountant (when ``config.sample_rate`` is set).
        """
        if not (isinstance(expected_batch_size, (int, float)) and expected_batch_size > 0):
            raise ValueError(f"engine.finalize: expected_batch_size must be > 0, got {expected_batch_size!r}")
        if self._accum is None:
            raise RuntimeError("engine.finalize: nothing accumulated since the last finalize; call "
                               "engine.accumulate(...) for each physical batch first (an empty logical "
                               "batch is one fully masked physical batch)")
        sigma_c = self.config.noise_multiplier * self.config.max_grad_norm
        params = dict(self.model.named_parameters())
        _, _, ctx = self._train
        with self.parallel.collective_errors():
            full = {name: self.parallel.full_clipped_sum(total, ctx.shard_dims.get(name))
                    for name, total in self._accum.items()}
        for name, total in full.items():
            if sigma_c > 0:
                noise = torch.randn(total.shape, generator=self._noise, dtype=torch.float32,
                                    device=self._noise.device)
                total = total + sigma_c * noise
            p = params[name]
            p.grad = (total / expected_batch_size).to(device=p.device, dtype=p.dtype)
        self._accum = None
        if self.config.sample_rate is not None:
            self.accountant.step(self.config.noise_multiplier, self.config.sample_rate)

    def epsilon(self, delta: float) -> float:
        """ε spent so far at ``delta``, from dp-accounting (``config.accountant``)."""
        if self.config is None or self.config.sample_rate is None:
            raise ValueError("engine.epsilon: set DPConfig(sample_rate=q) so the accountant knows q")
        return self.accountant.epsilon(delta, method=self.config.accountant)

    # --- inspection -----------------------------------------------------------------------
    def per_sample_grads(self, *batch) -> dict[str, torch.Tensor]:
        """name -> per-sample gradient (B, *param.shape), full and unsharded (for tests)."""
        self._check_shapes(batch)
        if self._inspect is None:
            self._inspect = self._compile(batch, [batch_dims, per_sample])
        captured, gm, _ = self._inspect
        B = batch[0].shape[0]
        cotangent = torch.ones(B, dtype=val(captured.cotangent_placeholder()).dtype)
        args = captured.gather_args(self.model, self.parallel.shard(batch), cotangent, dtype=self._dtype())
        with torch.no_grad(), self.parallel.collective_errors():
            _, *grads = gm(*args)
            # Each cp rank holds the partial gradient of its tokens; the full one is their sum.
            grads = [self.parallel.sum_over_cp(g) for g in grads]
        return dict(zip(captured.param_names, grads))

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Accountant and noise-generator state (not the model or optimizer)."""
        if self._accum is not None:
            raise RuntimeError("engine.state_dict: save between finalize and the next accumulate")
        return {"accountant": self.accountant.state_dict(), "noise_rng": self._noise.get_state(),
                "config": repr(self.config)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("config") != repr(self.config):
            raise ValueError(f"engine.load_state_dict: checkpoint DP config {state.get('config')} differs "
                             f"from this engine's {self.config!r}")
        self.accountant.load_state_dict(state["accountant"])
        self._noise.set_state(state["noise_rng"])

    def communication_bytes(self) -> dict[str, int]:
        """Bytes each kind of collective in the training graph moves per physical batch.

        From the graph's fake-tensor metadata: a reduce-scatter or all-reduce counts its
        input's bytes, an all-gather the gathered buffer; ring attention counts the K/V
        blocks it forwards ((cp-1) hops of K and V forward; K and V, and fp32 dK and dV,
        backward). The input-stationary per-sample gradient collectives do not depend on
        T; ring attention's and the output-stationary all-gathers do.
        """
        if self._train is None:
            raise RuntimeError("engine.communication_bytes: run accumulate once first (capture is lazy)")
        return self.parallel.communication_bytes(self._train[1])

    def __repr__(self) -> str:
        lines = [f"Engine(config={self.config!r}, captures={self.captures}, {self.parallel})"]
        for title, compiled in (("training graph", self._train), ("per-sample graph", self._inspect)):
            if compiled is None:
                continue
            _, gm, ctx = compiled
            lines.append(f" {title}: passes")
            lines.append(format_log(ctx.log))
            lines.append("  per-sample rules: " + ", ".join(f"{n}={r}" for n, r in ctx.rules_used.items()))
        if len(lines) == 1:
            lines.append(" not compiled yet (capture happens at the first call)")
        return "\n".join(lines)
