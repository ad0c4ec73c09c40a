"""Engine: noise once per logical batch, fixed shapes, accounting, checkpoints, bf16, bad input,
capture guards."""
import collections
import copy
import logging
import math
import pickle

import pytest
import torch
import torch.nn as nn

import longshield_fx as lf
from longshield_fx.runtime.accounting import epsilon_for

from longshield_fx.data import PoissonBatches
from longshield_fx.runtime import traces
from oracles import MLP, assert_matches_vmap, logical, mlp_batch, tiny_llama, token_batch, vmap_per_sample_grads


class Constant(nn.Module):
    """A model whose gradient is exactly zero: only noise reaches .grad."""

    def __init__(self, n=4000):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return (self.w.sum() * 0.0) + x.sum(1) * 0.0


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_noise_std_is_sigma_c_over_expected_batch_size(micro_batches):
    sigma, C, L = 1.3, 0.7, 8.0
    model = Constant()
    engine = lf.compile(model, config=lf.DPConfig(C, sigma))
    for _ in range(micro_batches):  # noise must not be added per micro-batch
        engine.accumulate(torch.randn(4, 2))
    engine.finalize(logical(4 * micro_batches, L))
    g = model.w.grad
    n = g.numel()
    expected = sigma * C / L
    # Sample std of n Gaussians has std ≈ expected / sqrt(2n); allow 5 of those.
    assert abs(float(g.std()) - expected) <= 5 * expected / math.sqrt(2 * n)
    assert abs(float(g.mean())) <= 5 * expected / math.sqrt(n)


def test_fixed_shape_engine_never_recaptures_across_poisson_batches():
    torch.manual_seed(0)
    N, T, steps = 40, 8, 20
    tokens = torch.randint(0, 256, (N, T))
    model = tiny_llama()
    q = 0.1
    engine = lf.compile(model, config=lf.DPConfig(1.0, 1.0))
    sizes = []
    for batch in PoissonBatches(tokens, sample_rate=q, physical_batch_size=3, steps=steps):
        sizes.append(batch.size)
        for (ids,), mask in batch.physical:
            engine.accumulate(ids, ids, mask=mask)
        engine.finalize(batch)
    assert len(set(sizes)) > 2  # the logical batch size varied, the graph did not
    # An empty logical batch (q so small that nothing is sampled) is one fully masked
    # physical batch of the same shape: noise only, still no recapture.
    (empty,) = PoissonBatches(tokens, sample_rate=1e-12, physical_batch_size=3, steps=1)
    assert empty.size == 0 and len(empty.physical) == 1
    (ids,), mask = empty.physical[0]
    engine.accumulate(ids, ids, mask=mask)
    engine.finalize(empty)
    assert all(torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in model.parameters())
    assert engine.captures == 1
    assert engine.accountant.steps == steps + 1
    assert engine.accountant.history == [(1.0, q, steps), (1.0, 1e-12, 1)]  # q from the sampler


def test_epsilon_agrees_with_dp_accounting():
    model = MLP()
    q, sigma = 0.05, 1.1
    engine = lf.compile(model, config=lf.DPConfig(1.0, sigma))
    for _ in range(7):
        engine.accumulate(*mlp_batch())
        engine.finalize(logical(4, 4.0, sample_rate=q))
    assert engine.config.accountant == "pld"  # the default is the tightest accountant
    assert engine.epsilon(1e-5) == pytest.approx(epsilon_for(sigma, q, 7, 1e-5, method="pld"), rel=1e-9)


def run_steps(engine, opt, data: torch.Generator, n: int):
    for _ in range(n):
        ids = torch.randint(0, 256, (2, 12), generator=data)
        engine.accumulate(ids, ids)
        engine.finalize(logical(2, 2.0, sample_rate=0.01))
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("sigma", [0.0, 0.8])
def test_checkpoint_resume_continues_the_run_with_fresh_noise(tmp_path, sigma):
    """A resumed run continues the model, the optimizer and the accountant: without noise it is
    bit-identical to the uninterrupted one; with noise every parameter differs, since the resumed
    engine draws from a fresh key (a restored stream would repeat the uninterrupted run's draws)."""
    cfg = lf.DPConfig(1.0, sigma)

    def fresh():
        model = tiny_llama(seed=1)
        return model, lf.compile(model, config=cfg), torch.optim.AdamW(model.parameters(), lr=1e-2)

    # (a) 3 steps, a checkpoint, 3 more steps; (c) a new run resumed from the checkpoint.
    model_a, engine_a, opt_a = fresh()
    data = torch.Generator().manual_seed(0)
    run_steps(engine_a, opt_a, data, 3)
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict(), "engine": engine_a.state_dict(),
                "data_rng": data.get_state()}, tmp_path / "ckpt.pt")
    run_steps(engine_a, opt_a, data, 3)
    model_c, engine_c, opt_c = fresh()
    state = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    model_c.load_state_dict(state["model"])
    opt_c.load_state_dict(state["opt"])
    engine_c.load_state_dict(state["engine"])
    data.set_state(state["data_rng"])
    run_steps(engine_c, opt_c, data, 3)
    for (name, a), (_, c) in zip(model_a.named_parameters(), model_c.named_parameters()):
        assert torch.equal(a, c) == (sigma == 0), name
    assert engine_c.epsilon(1e-5) == engine_a.epsilon(1e-5)
    assert engine_c.accountant.steps == 6


def test_loading_an_older_state_is_refused_unless_forked_and_a_fork_keeps_the_later_step_accounted():
    model = MLP()
    engine = lf.compile(model, config=lf.DPConfig(1.0, 0.5))
    engine.accumulate(*mlp_batch())
    engine.finalize(logical(4, 4.0, sample_rate=0.1))
    old = engine.state_dict()
    engine.accumulate(*mlp_batch())
    engine.finalize(logical(4, 4.0, sample_rate=0.1))
    eps = engine.epsilon(1e-5)
    with pytest.raises(ValueError, match="the state is at step 1, this engine already took step 2"):
        engine.load_state_dict(old)
    assert engine.epsilon(1e-5) == eps  # nothing changed
    engine.load_state_dict(old, fork=True)
    assert engine.accountant.steps == 1
    assert engine.epsilon(1e-5) == eps  # step 2 was released: the fork still counts it
    engine.accumulate(*mlp_batch())
    engine.finalize(logical(4, 4.0, sample_rate=0.1))  # step 2 again: the same batch released twice
    assert engine.epsilon(1e-5) == pytest.approx(_composed([(0.5, 0.1), (0.5 / 2 ** 0.5, 0.1)]), rel=1e-9)
    assert engine.epsilon(1e-5) > epsilon_for(0.5, 0.1, 3, 1e-5)  # more than three independent draws


def _composed(steps):
    """ε at δ = 1e-5 of Poisson-sampled Gaussian steps [(σ, q)], by dp-accounting's own PLD accountant."""
    import dp_accounting

    accountant = dp_accounting.pld.PLDAccountant()
    for sigma, q in steps:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)))
    return accountant.get_epsilon(1e-5)


def test_one_checkpoint_continued_twice_on_neighbouring_data_draws_fresh_noise_each_time():
    """Two fresh engines load one state and take the next step on neighbouring batches (the second
    without sample 0). Had the load restored the noise stream, their released gradients would differ
    by exactly sample 0's clipped gradient / E; with a fresh key per load they differ by noise.
    A rollback of the engine that saved the state draws fresh noise too."""
    C, sigma, E = 1.0, 1.0, 4.0
    x, y = mlp_batch()
    saver = lf.compile(MLP(), config=lf.DPConfig(C, sigma))
    saver.accumulate(x, y)
    saver.finalize(logical(4, E, sample_rate=0.1))
    state = saver.state_dict()

    def continued(engine, mask):
        engine.accumulate(x, y, mask=mask)
        engine.finalize(logical(int(mask.sum()), E, sample_rate=0.1))
        grads = torch.cat([p.grad.flatten() for p in engine.model.parameters()])
        engine.model.zero_grad(set_to_none=True)
        return grads

    releases = []
    for mask in (torch.ones(4), torch.tensor([0.0, 1, 1, 1])):
        engine = lf.compile(MLP(), config=lf.DPConfig(C, sigma))
        engine.load_state_dict(state)
        releases.append(continued(engine, mask))
    clipped_sample = (continued(lf.compile(MLP(), config=lf.DPConfig(C, 0.0)), torch.tensor([1.0, 0, 0, 0])))
    difference = releases[0] - releases[1]
    assert 0 < float(clipped_sample.norm()) <= C / E * (1 + 1e-6)
    # Two independent noise draws differ by N(0, 2σ²C²/E²) per coordinate: norm ~ sqrt(2·d)·σC/E.
    d = difference.numel()
    assert float((difference - clipped_sample).norm()) > 0.5 * math.sqrt(2 * d) * sigma * C / E
    after_save = continued(saver, torch.ones(4))
    saver.load_state_dict(state, fork=True)
    rolled_back = continued(saver, torch.ones(4))
    assert float((after_save - rolled_back).norm()) > 0.5 * math.sqrt(2 * d) * sigma * C / E


def test_engine_state_holds_the_sampling_stream_and_never_the_noise_key():
    engine = lf.compile(MLP(), config=lf.DPConfig(1.0, 0.5))
    x, y = mlp_batch(B=4)
    sampler = PoissonBatches(torch.utils.data.TensorDataset(x, y), sample_rate=0.5, physical_batch_size=4)
    state = engine.state_dict(sampler)
    assert set(state) == {"accountant", "nonfinite_samples", "config", "sampler"}
    assert engine._noise.stream.key not in pickle.dumps(state)
    after = [b.indices.tolist() for b in sampler]
    resumed = PoissonBatches(torch.utils.data.TensorDataset(x, y), sample_rate=0.5, physical_batch_size=4)
    with pytest.raises(ValueError, match="pass the sampler"):
        lf.compile(MLP(), config=lf.DPConfig(1.0, 0.5)).load_state_dict(state)
    lf.compile(MLP(), config=lf.DPConfig(1.0, 0.5)).load_state_dict(state, resumed)
    assert [b.indices.tolist() for b in resumed] == after  # the same secret sampling stream


def test_finalize_takes_q_from_the_sampler_and_checks_the_batch():
    model = MLP()
    engine = lf.compile(model, config=lf.DPConfig(1.0, 1.0))
    x, y = mlp_batch(B=4)
    dataset = torch.utils.data.TensorDataset(x.repeat(5, 1, 1), y.repeat(5, 1))
    sampler = PoissonBatches(dataset, sample_rate=0.25, physical_batch_size=4)
    batch = next(b for b in sampler if b.size > 0)
    for (bx, by), mask in batch.physical:
        engine.accumulate(bx, by, mask=mask)
    engine.finalize(batch)
    assert engine.accountant.history == [(1.0, 0.25, 1)]
    assert batch.expected_size == 0.25 * 20
    # Accumulating one physical batch too few (or too many) is refused, not accounted.
    engine.accumulate(x, y, mask=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="2 real samples were accumulated.*logical batch has 3"):
        engine.finalize(logical(3, 5.0, sample_rate=0.25))
    with pytest.raises(TypeError, match="LogicalBatch"):
        engine.finalize(5.0)
    assert engine.accountant.steps == 1


def test_checkpoint_from_other_config_is_refused():
    engine = lf.compile(MLP(), config=lf.DPConfig(1.0, 0.5))
    other = lf.compile(MLP(), config=lf.DPConfig(2.0, 0.5))
    with pytest.raises(ValueError, match="DP config"):
        other.load_state_dict(engine.state_dict())


def test_bf16_tracks_fp32_loss():
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_llama(seed=0)
        engine = lf.compile(model, config=lf.DPConfig(1.0, 0.0, compute_dtype=dtype))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 256, (4, 32), generator=g)
        out = []
        for _ in range(20):
            loss = engine.accumulate(ids, ids)
            assert torch.isfinite(loss)
            engine.finalize(logical(4, 4.0))
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())
            assert all(p.dtype == torch.float32 for p in model.parameters())
            opt.step()
            opt.zero_grad()
            out.append(float(loss))
        losses[dtype] = out
    assert losses[torch.float32][-1] < losses[torch.float32][0]  # it trains
    for a, b in zip(losses[torch.float32], losses[torch.bfloat16]):
        assert abs(a - b) <= 0.02 * abs(a)


def test_a_bf16_capture_refuses_a_forward_replaced_by_a_function_holding_the_original():
    """The compute-dtype capture copies the model; a forward replaced on the instance by a closure
    over the original bound forward (as TRL's fused-head patch does) would run the original's
    weights in the copy, so its trainable copies would get no gradient: refused by name."""
    model = MLP()
    original = model.forward

    def patched(self, *batch):
        return original(*batch)

    model.forward = patched.__get__(model)
    engine = lf.compile(model, config=lf.DPConfig(1.0, 1.0, compute_dtype=torch.bfloat16))
    with pytest.raises(lf.UnsupportedModelError, match="replaced by .*patched.* holds a module"):
        engine.accumulate(*mlp_batch(4))


def test_bad_input_is_refused_and_changes_nothing():
    model = MLP()
    engine = lf.compile(model, config=lf.DPConfig(1.0, 1.0))
    x, y = mlp_batch(B=4)
    with pytest.raises(RuntimeError, match="nothing accumulated"):
        engine.finalize(logical(4, 4.0))
    with pytest.raises(ValueError, match=r"mask must have shape \(4,\)"):
        engine.accumulate(x, y, mask=torch.ones(3))
    with pytest.raises(ValueError, match="only 0"):
        engine.accumulate(x, y, mask=torch.full((4,), 0.5))
    engine.accumulate(x, y)
    before = {n: t.clone() for n, t in engine._accum.items()}
    with pytest.raises(ValueError, match="4 real samples were accumulated"):
        engine.finalize(logical(3, 4.0))
    assert all(torch.equal(before[n], engine._accum[n]) for n in before)  # still there
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="shapes changed"):
        engine.accumulate(*mlp_batch(B=5))
    for kwargs, match in (({"max_grad_norm": 0.0, "noise_multiplier": 1.0}, "max_grad_norm"),
                          ({"max_grad_norm": 1.0, "noise_multiplier": -0.1}, "noise_multiplier"),
                          ({"max_grad_norm": 1.0, "noise_multiplier": 1.0, "clipping": "nope"}, "clipping"),
                          ({"max_grad_norm": 1.0, "noise_multiplier": 1.0, "insecure_seed": "0"},
                           "insecure_seed")):
        with pytest.raises(ValueError, match=match):
            lf.DPConfig(**kwargs)


def test_default_noise_differs_between_engines():
    grads = []
    for _ in range(2):
        model = Constant(100)
        engine = lf.compile(model, config=lf.DPConfig(1.0, 1.0))
        engine.accumulate(torch.randn(2, 2))
        engine.finalize(logical(2))
        grads.append(model.w.grad.clone())
    assert not torch.equal(*grads)


def _hook_state(model):
    import torch.nn.modules.module as M
    state = []
    for m in model.modules():
        state += [len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                  len(m._backward_pre_hooks), len(getattr(m, "_state_dict_hooks", {}))]
    for p in model.parameters():
        state.append(p._backward_hooks is None or len(p._backward_hooks) == 0)
        state.append(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}))
    state += [len(M._global_forward_hooks), len(M._global_forward_pre_hooks), len(M._global_backward_hooks),
              len(M._global_backward_pre_hooks), len(M._global_module_registration_hooks)]
    return state


def test_no_hooks_during_compile_and_run(hook_calls, tiny, tokens):
    """No hook is registered on the model, its modules, its tensors, or globally."""
    model = tiny
    before = _hook_state(model)
    engine = lf.compile(model, config=lf.DPConfig(1.0, 1.0))
    ids, labels = tokens
    engine.accumulate(ids, labels)
    engine.finalize(logical(3, 3.0))
    engine.per_sample_grads(ids, labels)
    assert hook_calls == []
    assert _hook_state(model) == before
    assert all(v in (0, True) for v in before)


# --- capture guards ----------------------------------------------------------------------------

class ModeScaled(nn.Module):
    """MLP whose hidden layer reads Python state in the forward: doubled in training mode (a
    dropout-free stand-in for mode-dependent forwards), times the float ``scale`` and the
    dict entry ``options["shift"]`` (a container: only dynamo's guards see it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.scale = 1.0
        self.options = {"shift": 0.0}

    def forward(self, x, y):
        h = torch.tanh(self.fc1(x) + self.options["shift"]) * self.scale * (2.0 if self.training else 1.0)
        logits = self.fc2(h)
        return nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none").sum(1)


CHANGES = {  # name -> (change, what the recapture's log line names)
    "eval": (lambda m: m.eval(), "training: True -> False"),
    "attribute": (lambda m: setattr(m, "scale", 3.0), "scale: 1.0 -> 3.0"),
    "frozen": (lambda m: m.fc1.bias.requires_grad_(False), "parameter fc1.bias: requires_grad True -> False"),
    "container": (lambda m: m.options.update(shift=0.5), "options['shift']"),
    "replaced": (lambda m: setattr(m.fc2, "weight", nn.Parameter(torch.randn(3, 8))),
                 "parameter fc2.weight: replaced by another tensor"),
    "resized": (lambda m: [setattr(m.fc1.weight, "data", torch.randn(5, 6)), setattr(m.fc1.bias, "data", torch.randn(5)),
                           setattr(m.fc2.weight, "data", torch.randn(3, 5))],
                "parameter fc1.weight: shape (8, 6) -> (5, 6)"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_model_change_recaptures_and_matches_the_oracle(change, caplog):
    """Python state the forward reads is baked into a capture: after a change the engine
    recaptures, and its per-sample gradients are the oracle's in the new state."""
    model, batch = ModeScaled(), mlp_batch()
    engine = lf.compile(model)
    before = assert_matches_vmap(model, batch, engine.per_sample_grads(*batch))
    apply, named = CHANGES[change]
    apply(model)
    with caplog.at_level(logging.INFO, logger="longshield_fx.runtime.engine"):
        after = assert_matches_vmap(model, batch, engine.per_sample_grads(*batch))
    assert engine.captures == 2
    assert named in caplog.text
    # The change matters: the graph captured before it would give other gradients.
    a, b = after["fc2.weight"], before["fc2.weight"]
    assert set(after) != set(before) or a.shape != b.shape or not torch.allclose(a, b)


def test_a_dtype_change_recaptures_and_matches_the_oracle(caplog):
    model, batch = tiny_llama(), token_batch(B=2, T=8)
    engine = lf.compile(model)
    engine.per_sample_grads(*batch)
    model.double()  # keeps each parameter's identity, changes its dtype; the token ids stay as they are
    with caplog.at_level(logging.INFO, logger="longshield_fx.runtime.engine"):
        grads = assert_matches_vmap(model, batch, engine.per_sample_grads(*batch))
    assert engine.captures == 2 and "dtype torch.float32 -> torch.float64" in caplog.text
    assert all(g.dtype == torch.float64 for g in grads.values())


def test_a_change_inside_a_logical_batch_is_refused():
    C, E = 1e6, 8.0  # no clipping, no noise: .grad is the oracle's sum / E
    model, batch = ModeScaled(), mlp_batch()
    engine = lf.compile(model, config=lf.DPConfig(C, 0.0))
    engine.accumulate(*batch)
    model.eval()
    with pytest.raises(ValueError, match=r"changed since this logical batch's first accumulate \(the training "
                                         r"flag of 3 modules \(training: True -> False.*after engine.finalize"):
        engine.accumulate(*batch)
    model.train()  # undone: the logical batch can be finished with the graph it started with
    engine.accumulate(*batch)
    engine.finalize(logical(8, E))
    model.eval()  # between steps: recaptured
    engine.accumulate(*batch)
    engine.accumulate(*batch)
    engine.finalize(logical(8, E))
    assert engine.captures == 2
    ref = vmap_per_sample_grads(model, batch)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * ref[name].sum(0) / E, atol=1e-6, rtol=1e-5, msg=name)


def test_an_unchanged_model_is_not_recaptured():
    """Optimizer steps (in place), an eager evaluation in eval mode between steps that
    returns to train mode, and the caller's grad mode change nothing the graph depends on."""
    model, batch = ModeScaled(), mlp_batch()
    engine = lf.compile(model, config=lf.DPConfig(1.0, 0.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        engine.accumulate(*batch)
        engine.finalize(logical(4, 4.0))
        opt.step()
        model.eval()
        with torch.no_grad():
            model(*batch)
        model.train()
    with torch.no_grad():
        engine.accumulate(*batch)
    engine.finalize(logical(4, 4.0))
    assert engine.captures == 1


def test_engines_of_models_alike_share_one_trace_until_a_model_changes(monkeypatch):
    """Another engine of the model (another config, a disabled pass) or of a copy of it traces
    nothing and computes what a fresh trace does; a change the trace depends on (eval mode) or
    another batch shape makes the next engine trace anew."""
    monkeypatch.setattr(traces, "_TRACES", collections.OrderedDict())  # none from earlier tests
    model, batch = ModeScaled(), mlp_batch()
    first = lf.compile(model, config=lf.DPConfig(1.0, 0.0))
    first.per_sample_grads(*batch)
    again, alike = lf.compile(model, disable_passes=("ghost_norm",)), lf.compile(copy.deepcopy(model))
    grads = assert_matches_vmap(model, batch, again.per_sample_grads(*batch))
    with torch.no_grad():
        next(model.parameters()).mul_(2)  # a value, not the structure: the trace still serves
    twice = alike.per_sample_grads(*batch)
    assert [(e.captures, e.traces) for e in (first, again, alike)] == [(1, 1), (1, 0), (1, 0)]
    for name, g in grads.items():
        torch.testing.assert_close(twice[name], g, rtol=0, atol=0, msg=name)
    model.eval()
    evaluating = lf.compile(model)
    assert_matches_vmap(model, batch, evaluating.per_sample_grads(*batch))
    model.train()
    fewer = lf.compile(model)
    fewer.per_sample_grads(*(t[:2] for t in batch))
    assert (evaluating.traces, fewer.traces) == (1, 1)


class ConstantScaled(nn.Module):
    """A plain tensor attribute (not a buffer): the trace bakes its value in."""

    def __init__(self, scale: float):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.scale = torch.tensor(scale)

    def forward(self, x, y):
        return nn.functional.cross_entropy((self.fc(x) * self.scale).transpose(1, 2), y, reduction="none").sum(1)


def test_traces_with_a_tensor_constant_or_of_a_hooked_model_are_not_shared():
    """A plain tensor attribute is baked into the graph (other instances, or the same one after
    it is reassigned, hold other values), and module hooks are in neither the key nor dynamo's
    guards: each engine traces its own."""
    batch = mlp_batch()
    one = ConstantScaled(1.0)
    three = copy.deepcopy(one)
    three.scale = torch.tensor(3.0)
    for model in (one, three, one):
        engine = lf.compile(model)
        assert_matches_vmap(model, batch, engine.per_sample_grads(*batch))
        assert engine.traces == 1
        one.scale = torch.tensor(2.0)
    hooked = MLP()
    lf.compile(copy.deepcopy(hooked)).per_sample_grads(*batch)
    hooked.fc1.register_forward_hook(lambda module, args, out: out * 10)
    engine = lf.compile(hooked)
    assert_matches_vmap(hooked, batch, engine.per_sample_grads(*batch))
    assert engine.traces == 1


class WithAnUnusedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.unused = nn.Linear(6, 3), nn.Linear(2, 2)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.fc(x).transpose(1, 2), y, reduction="none").sum(1)


def test_a_shared_trace_gives_its_warnings_again():
    """The warning of a parameter the loss never reaches comes with every engine, traced or not."""
    batch = mlp_batch()
    for _ in range(2):
        engine = lf.compile(WithAnUnusedLayer())
        with pytest.warns(UserWarning, match=r"\['unused.weight', 'unused.bias'\] get no gradient from the loss"):
            engine.per_sample_grads(*batch)
    assert engine.traces == 0


def test_repeated_recaptures_warn(monkeypatch):
    """An attribute that changes every step recaptures every step: say so once, and how to avoid it."""
    from longshield_fx.runtime import engine as engine_module
    monkeypatch.setattr(engine_module, "_RECAPTURE_WARNING", 2)
    model, batch = ModeScaled(), mlp_batch()
    engine = lf.compile(model)
    engine.per_sample_grads(*batch)
    model.scale = 2.0
    with pytest.warns(RuntimeWarning, match=r"changed again \(scale: 1.0 -> 2.0\); this is capture 2 of the "
                                            r"per_sample graph.*tensor buffer"):
        engine.per_sample_grads(*batch)


@pytest.mark.parametrize("backend, threads, overlapped", [("gloo", 2, False), ("serial", 1, True)])
def test_overlap_is_left_out_where_gloo_runs_collectives_on_several_threads(backend, threads, overlapped):
    """torch's gloo groups finish collectives on two worker threads that race (a double free in
    ``ProcessGroupGloo::runLoop``, ``_torch.serial_gloo``), and the overlap pass keeps several in
    flight: under such a mesh the pass is left out. ``serial_gloo()`` groups (the CLI's and the
    multi-process tests') have one worker thread, DeviceMesh's too, and keep it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from longshield_fx._torch import gloo_worker_threads, serial_gloo

    dist.init_process_group("gloo" if backend == "gloo" else serial_gloo(), rank=0, world_size=1,
                            store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
        assert gloo_worker_threads(dist.group.WORLD) == gloo_worker_threads(mesh.get_group(0)) == threads
        engine = lf.compile(tiny_llama(), mesh, config=lf.DPConfig(1.0, 0.0), fsdp=("cp",))
        assert ("overlap" in [p.__name__ for p in engine.pipelines["train"]]) == overlapped
    finally:
        dist.destroy_process_group()


def test_lowering_leaves_the_garbage_collectors_thresholds_as_it_found_them():
    """Capture and lowering run the cyclic GC less often (``engine._fewer_gc_passes``), and give
    the process its own thresholds back, after a graph and after a refusal."""
    import gc

    kept = gc.get_threshold()
    try:
        gc.set_threshold(1234, 5, 6)
        lf.compile(MLP(), config=lf.DPConfig(1.0, 0.0)).per_sample_grads(*mlp_batch())
        assert gc.get_threshold() == (1234, 5, 6)

        class BatchMixing(nn.Module):  # mixes samples: refused while lowering
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(3))

            def forward(self, x):
                return (x * self.w).sum(1) + (x * self.w).mean()

        with pytest.raises(lf.UnsupportedModelError):
            lf.compile(BatchMixing(), config=lf.DPConfig(1.0, 0.0)).per_sample_grads(torch.randn(4, 3))
        assert gc.get_threshold() == (1234, 5, 6)
    finally:
        gc.set_threshold(*kept)
