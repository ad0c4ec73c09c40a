"""The training steps ``step_overhead.py`` compares: one builder per method, each returning a
closure that runs one training step (forward, backward, [clip, noise,] AdamW step) of the
reference Llama ``small`` in ``CausalLMLoss`` on a fixed (B, T) batch."""
from __future__ import annotations

C, SIGMA, LR = 1.0, 1.0, 1e-4


def _register_rmsnorm_grad_sampler():
    """Opacus has no per-sample rule for the reference Llama's RMSNorm: give it one."""
    import torch
    from opacus.grad_sample import register_grad_sampler

    from longshield_fx.models.llama import RMSNorm

    @register_grad_sampler(RMSNorm)
    def rmsnorm_grad_sample(layer, activations, backprops):
        x = activations[0].float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.eps)
        return {layer.weight: torch.einsum("b...d,b...d->bd", backprops, normed.to(x.dtype))}


class _PerSampleLossCriterion:
    """Opacus ghost clipping's criterion: the model already returns per-sample losses (B,).

    ``DPLossFastGradientClipping`` sets ``reduction="none"`` around the call and wraps the
    (B,) result; "sum" is what the non-private objective uses.
    """

    def __init__(self):
        self.reduction = "sum"

    def __call__(self, per_sample_loss):
        return per_sample_loss if self.reduction == "none" else per_sample_loss.sum()


def _eager(model, ids, B):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step():
        model(ids, ids).sum().backward()
        opt.step()
        opt.zero_grad()
    return step


def _captured(model, ids, B):
    """The captured aten graph (``longshield_fx.capture``), no DP passes."""
    import torch

    import longshield_fx as lf

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    params = dict(model.named_parameters())
    state = {}

    def step():
        if "cg" not in state:
            state["cg"] = lf.capture(model, (ids, ids))
        cg = state["cg"]
        with torch.no_grad():
            _, *grads = cg.gm(*cg.gather_args(model, (ids, ids), torch.ones(B)))
        for name, g in zip(cg.param_names, grads):
            params[name].grad = g
        del grads
        opt.step()
        opt.zero_grad()
    return step


def _longshield(model, ids, B, checkpoint=None, disable_passes=()):
    """The step; ``step.engine`` is the compiled engine (for what its passes recorded)."""
    import torch

    import longshield_fx as lf

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = lf.compile(model, config=lf.DPConfig(C, SIGMA), checkpoint=checkpoint, disable_passes=disable_passes)
    # All B rows in every logical batch (N = B, q = 1): finalize divides by E[B] = B, as before.
    logical = lf.data.LogicalBatch(size=B, indices=torch.arange(B), physical=[], sample_rate=1.0,
                                   expected_size=float(B))

    def step():
        engine.accumulate(ids, ids)
        engine.finalize(logical)
        opt.step()
        opt.zero_grad()
    step.engine = engine
    return step


def _opacus(model, ids, B, mode):
    import torch
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    _register_rmsnorm_grad_sampler()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(TensorDataset(ids, ids), batch_size=B)
    common = dict(optimizer=opt, data_loader=loader, noise_multiplier=SIGMA, max_grad_norm=C,
                  loss_reduction="sum", poisson_sampling=False, clipping="flat",
                  noise_generator=torch.Generator().manual_seed(0))
    if mode == "hooks":
        gsm, dp_opt, _ = PrivacyEngine().make_private(module=model, grad_sample_mode="hooks", **common)

        def step():
            gsm(ids, ids).sum().backward()
            dp_opt.step()
            dp_opt.zero_grad()
        return step
    gsm, dp_opt, dp_loss, _ = PrivacyEngine().make_private(
        module=model, grad_sample_mode="ghost", criterion=_PerSampleLossCriterion(), **common)

    def step():
        dp_loss(gsm(ids, ids)).backward()  # two backward passes: norms, then clipped sum
        dp_opt.step()
        dp_opt.zero_grad()
    return step


def _vmap(model, ids, B):
    """torch.func per-sample gradients, manual flat clip + noise."""
    import torch
    from torch.func import functional_call, grad, vmap

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    named = dict(model.named_parameters())
    noise = torch.Generator().manual_seed(0)

    def sample_loss(p, x, y):
        return functional_call(model, p, (x[None], y[None])).sum()

    per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))

    def step():
        params = {k: v.detach() for k, v in named.items()}
        g = per_sample_grads(params, ids, ids)
        with torch.no_grad():
            norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
            factor = (C / (norms + 1e-6)).clamp(max=1.0)
            for k, v in g.items():
                total = torch.einsum("b,b...->...", factor, v)
                total += SIGMA * C * torch.randn(total.shape, generator=noise)
                named[k].grad = total / B
        del g
        opt.step()
        opt.zero_grad()
    return step


BUILDERS = {
    "eager": _eager,
    "captured": _captured,
    "dp": _longshield,
    "dp_block": lambda model, ids, B: _longshield(model, ids, B, checkpoint="block"),
    "opacus_hooks": lambda model, ids, B: _opacus(model, ids, B, "hooks"),
    "opacus_ghost": lambda model, ids, B: _opacus(model, ids, B, "ghost"),
    "vmap": _vmap,
}


def make_step(method: str, T: int, B: int):
    """Build the model and optimizer for ``method``; return a closure running one training step."""
    import torch

    import longshield_fx as lf
    from longshield_fx.models import Llama

    if method not in BUILDERS:
        raise ValueError(f"unknown method {method!r}")
    torch.manual_seed(0)
    model = lf.CausalLMLoss(Llama.from_name("small"))
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    return BUILDERS[method](model, ids, B)
