"""Shared test oracles (what our results are compared against) and the tiny models and batches
they run on, and how a failed launch is reported. Imported by tests, ``conftest.py`` and
``runtime/cp_worker.py`` alike."""
import re
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import longshield_fx as lf
from longshield_fx.data import LogicalBatch
from longshield_fx.models import Llama
from longshield_fx.models.llama import LlamaConfig
from longshield_fx.packing import unit_pieces


def logical(size: int, expected_size: float = 1.0, sample_rate: float = 1.0) -> LogicalBatch:
    """A logical batch of ``size`` real samples, for ``engine.finalize`` in tests that pass
    their physical batches by hand (``expected_size`` is the divisor)."""
    return LogicalBatch(size=size, indices=torch.arange(size), physical=[], sample_rate=sample_rate,
                        expected_size=expected_size)


def per_sample_loop(model: nn.Module, samples: list[tuple]) -> dict:
    """float64 gradients of each sample's summed loss, the sample run alone: trainable parameter
    name -> (len(samples), *shape), zeros where the sample does not reach the parameter."""
    import copy

    model = copy.deepcopy(model).double()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = {n: [] for n in params}
    for sample in samples:
        sample = tuple(t.double() if t.is_floating_point() else t for t in sample)
        grads = torch.autograd.grad(model(*sample).sum(), list(params.values()), allow_unused=True)
        for (n, p), g in zip(params.items(), grads):
            out[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(v) if v else torch.zeros(0, *params[n].shape, dtype=torch.float64)
            for n, v in out.items()}


def vmap_per_sample_grads(model: nn.Module, batch) -> dict:
    """The oracle: torch.func per-sample gradients of each sample's loss."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss(p, *sample):
        return functional_call(model, (p, buffers), tuple(s[None] for s in sample)).sum()

    return vmap(grad(loss), in_dims=(None, *([0] * len(batch))))(params, *batch)


def assert_matches_vmap(model: nn.Module, batch, ours: dict | None = None, ref: dict | None = None,
                        atol: float = 1e-5) -> dict:
    """Our per-sample gradients (``ours``, or from a fresh ``lf.compile(model)``) against the
    torch.func oracle (``ref``, or computed): every trainable parameter, shape (B, *p.shape).
    Returns ours."""
    ours = lf.compile(model).per_sample_grads(*batch) if ours is None else ours
    ref = vmap_per_sample_grads(model, batch) if ref is None else ref
    B = batch[0].shape[0]
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(ours) == set(ref) == set(trainable)
    for name, p in trainable.items():
        assert ours[name].shape == (B, *p.shape), name
        torch.testing.assert_close(ours[name], ref[name], atol=atol, rtol=1e-4, msg=name)
    return ours


def tagged(model: nn.Module, batch) -> dict:
    """Node name -> node of ``model``'s captured graph after the ``batch_dims`` pass (each node's
    ``meta["batch_dim"]`` is its sample-dimension tag)."""
    from longshield_fx.capture import capture
    from longshield_fx.passes import PassContext
    from longshield_fx.passes.batch_dims import batch_dims

    captured = capture(model, batch)
    gm = batch_dims(captured.gm, PassContext(captured, batch[0].shape[0]))
    return {n.name: n for n in gm.graph.nodes}


class MLP(nn.Module):
    """Two linear layers with biases; per-sample loss is summed over a token axis."""

    def __init__(self, d_in=6, hidden=8, classes=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x, y):
        logits = self.fc2(F.relu(self.fc1(x)))  # (B, T, C)
        return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").sum(1)


def mlp_batch(B=4, T=5, d_in=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d_in, generator=g), torch.randint(0, classes, (B, T), generator=g)


def tiny_llama(seed=0, **overrides):
    torch.manual_seed(seed)
    return lf.CausalLMLoss(Llama.from_name("tiny", **overrides))


def token_batch(B=3, T=16, vocab=256, seed=0):
    ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
    return ids, ids.clone()


def hf_llama(seed=0):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    return lf.CausalLMLoss(transformers.LlamaForCausalLM(cfg))


def hf_qwen2(seed=0):
    """Four query heads sharing ONE K/V head: 2D attention must replicate it for hp >= 2."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    return lf.CausalLMLoss(transformers.Qwen2ForCausalLM(cfg))


def hf_gpt2(seed=0):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                  eos_token_id=None, tie_word_embeddings=True, attn_implementation="sdpa")
    return lf.CausalLMLoss(transformers.GPT2LMHeadModel(cfg))


# --- attention ------------------------------------------------------------------------------------

def attention_inputs(seed: int, B=2, HQ=4, HKV=2, T=32, D=8):
    """q (B, HQ, T, D), k and v (B, HKV, T, D) and an output gradient, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, T, D, generator=g)
    k = torch.randn(B, HKV, T, D, generator=g)
    v = torch.randn(B, HKV, T, D, generator=g)
    grad = torch.randn(B, HQ, T, D, generator=g)
    return q, k, v, grad


def causal_attention(q, k, v, grad):
    """The oracle for ring attention: full causal attention with the K/V heads repeated
    (GQA) by plain SDPA and autograd. Returns out, lse and (dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    _, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.detach(), kr.detach(), vr.detach(), 0.0, True)
    return out.detach(), lse, grads


def packed_segments(B: int, T: int, seed: int) -> torch.Tensor:
    """(B, T) document ids of rows packed with documents of random lengths (1 to T/2 tokens; the
    id is the row's index times T plus the document's first position: never shared across rows)."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.empty(B, T, dtype=torch.long)
    for b in range(B):
        t = 0
        while t < T:
            n = int(torch.randint(1, T // 2, (1,), generator=g))
            seg[b, t:t + n] = b * T + t
            t += n
    return seg


def document_attention(q, k, v, grad, segments):
    """The oracle for packed-document ring attention: each token attends causally within its own
    document (same id in ``segments`` (B, T)), by plain SDPA with the mask and autograd; lse
    from the masked scores. Returns out, lse and (dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    T = q.shape[2]
    mask = ((segments[:, :, None] == segments[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril())[:, None]
    out = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    scores = (q.detach() @ kr.detach().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return out.detach(), scores.masked_fill(~mask, float("-inf")).logsumexp(-1), grads


# --- packed documents (tests/passes/test_packed_documents.py; under cp, cp_worker.packed_case) ---

PACKED_T, PACKED_ROWS, PACKED_U, PACKED_C = 16, 4, 8, 0.05
PACKED_CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64,
                         rope_theta=10000.0)
# Units of one or two documents; 20 and 33 tokens span rows, the 2-token one predicts one token.
PACKED_LENGTHS = [[5, 3], [20], [7], [2], [9, 11], [13], [33], [4, 4, 4]]


def packed_units(seed: int = 1) -> list:
    """Units (lists of documents of token ids) of the lengths ``PACKED_LENGTHS``."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, PACKED_CFG.vocab_size, (n,), generator=g).tolist() for n in docs]
            for docs in PACKED_LENGTHS]


def packed_alone(lm, unit) -> dict:
    """The oracle of a packed unit's gradient: the sum over its pieces, each run alone as one row."""
    plain = lf.CausalLMLoss(lm)
    lm.zero_grad()
    for piece in unit_pieces(unit, PACKED_T):
        x = torch.tensor([piece])
        plain(x, x).sum().backward()
    return {f"lm.{n}": p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


def packed_hf(kind: str):
    """A small Hugging Face causal LM ("llama", "qwen2", "gpt2") with SDPA attention, eval mode."""
    import transformers
    small = dict(vocab_size=PACKED_CFG.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    config = {"llama": lambda: transformers.LlamaConfig(**small),
              "qwen2": lambda: transformers.Qwen2Config(**small),
              "gpt2": lambda: transformers.GPT2Config(vocab_size=PACKED_CFG.vocab_size, n_embd=32, n_layer=2,
                                                      n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)}[kind]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.eval()  # GPT-2's dropout off: the oracle runs the same function


def packed_model(kind: str):
    """"ref" (the reference Llama, seeded) or a ``packed_hf`` kind, as a ``PackedCausalLMLoss``."""
    if kind == "ref":
        torch.manual_seed(0)
        return lf.PackedCausalLMLoss(Llama(PACKED_CFG))
    return lf.PackedCausalLMLoss(packed_hf(kind))


# --- the distributed cases (tests/runtime/cp_worker.py runs them, test_parallel.py checks them) ---

class CPCase(NamedTuple):
    """A distributed case: ``world`` ranks, cp = world // (dp * hp)."""

    world: int
    kind: str  # case_model's key
    dp: int = 1
    policy: str | None = None  # checkpointing
    comm: str = "input_stationary"  # DPConfig.per_sample_comm
    hp: int = 1  # head-parallel degree (2D attention)
    inner_ring: int | None = None  # double ring: inner ring size
    fsdp: tuple | None = None  # mesh dims model states are sharded over
    reshard_after_forward: bool = True  # with fsdp: False keeps the forward's gathers for the backward
    # Only the first engine (per-sample gradients, clipped sum, training steps, bytes): no
    # second capture without the overlap pass, no noisy engine. For layouts whose overlap and
    # noise another case of the same mesh already checks.
    light: bool = False


CP_CASES = {
    "cp2-llama": CPCase(2, "llama"),
    "cp2-hf_llama": CPCase(2, "hf_llama"),
    "cp2-llama-block": CPCase(2, "llama", policy="block"),
    "cp2-hf_llama-selective": CPCase(2, "hf_llama", policy="selective"),
    "cp2-llama-output_stationary": CPCase(2, "llama", comm="output_stationary"),
    "cp2-llama_units": CPCase(2, "llama_units"),
    "cp4-llama": CPCase(4, "llama"),
    "cp4-hf_qwen2": CPCase(4, "hf_qwen2"),
    "dp2cp2-llama": CPCase(4, "llama", dp=2),
    "dp2cp2-hf_llama": CPCase(4, "hf_llama", dp=2),
    # 2D attention (hp x cp). The tiny Llama has 2 K/V heads, Qwen2 here 1: hp=4 replicates
    # both, hp=2 replicates Qwen2's.
    "hp2cp2-llama": CPCase(4, "llama", hp=2),
    "hp2cp2-hf_qwen2": CPCase(4, "hf_qwen2", hp=2),
    "hp2cp2-hf_qwen2-selective": CPCase(4, "hf_qwen2", policy="selective", hp=2),
    "hp2cp2-llama-selective": CPCase(4, "llama", policy="selective", hp=2, light=True),
    "hp4-llama": CPCase(4, "llama", hp=4),
    "hp4-hf_qwen2": CPCase(4, "hf_qwen2", hp=4),
    "hp4-hf_qwen2-selective": CPCase(4, "hf_qwen2", policy="selective", hp=4, light=True),
    "cp4-llama-selective": CPCase(4, "llama", policy="selective", light=True),
    "dp2hp2-llama": CPCase(4, "llama", dp=2, hp=2),
    "dp2hp2-hf_qwen2": CPCase(4, "hf_qwen2", dp=2, hp=2, light=True),
    # Double ring: cp=4 as two inner rings of 2.
    "cp4w2-llama": CPCase(4, "llama", inner_ring=2),
    "cp4w2-hf_qwen2": CPCase(4, "hf_qwen2", inner_ring=2),
    "cp4w2-hf_qwen2-selective": CPCase(4, "hf_qwen2", policy="selective", inner_ring=2, light=True),
    # Sharded model states: ZeRO-3 over every rank, and hybrid (sharded over cp, replicated over dp).
    # "llama_odd" shards unevenly over 4 ranks (dims 50, 95 and 250), also where the sequence group
    # shards a gradient along dim 1 (w1, w3: 95 x 50).
    "fsdp-dp2cp2-llama_odd": CPCase(4, "llama_odd", dp=2, fsdp=("dp", "cp")),
    "fsdp-dp2cp2-hf_qwen2": CPCase(4, "hf_qwen2", dp=2, fsdp=("dp", "cp")),
    "fsdp-dp2cp2-llama_odd-block": CPCase(4, "llama_odd", dp=2, policy="block", fsdp=("dp", "cp")),
    "fsdp-kept-dp2cp2-llama_odd": CPCase(4, "llama_odd", dp=2, fsdp=("dp", "cp"), reshard_after_forward=False,
                                         light=True),
    "hsdp-dp2cp2-llama": CPCase(4, "llama", dp=2, fsdp=("cp",)),
    "hsdp-over-dp-dp2cp2-llama": CPCase(4, "llama", dp=2, fsdp=("dp",)),  # replicated over cp
}
CP_CLIP = 0.05  # max_grad_norm of the distributed cases: small enough that samples are clipped
CP_NOISE_SEED, CP_NOISE_E = 7, 4.0  # the noisy run: insecure_seed, and the expected batch size it divides by
CALIBRATION = (8.0, 1e-5, 1.0, 1)  # cp_worker's "calibration": target ε, δ, q, steps (one Gaussian release: fast)


CP_STEPS, CP_LR = 3, 0.5  # the training run: SGD steps (noise 0) on each replica's batch


def llama_odd(seed=0):
    """The tiny Llama with widths that 4 shards do not divide: dim 50 (5 heads of 10, one K/V
    head), ffn 95 (odd: cp=2 shards w1 and w3 along dim 1), vocabulary 250."""
    return tiny_llama(seed, dim=50, n_heads=5, n_kv_heads=1, ffn_dim=95, vocab_size=250)


def case_model(kind: str):
    return {"llama": tiny_llama, "llama_units": tiny_llama, "hf_llama": hf_llama, "hf_qwen2": hf_qwen2,
            "llama_odd": llama_odd}[kind](seed=0)


def case_batches(kind: str, dp: int, T: int = 16, first_seed: int = 0) -> list:
    """One (2, T) batch of token ids per dp replica (input ids = labels), from seeds
    ``first_seed``, ``first_seed + 1``, ...; "llama_units": (2, 3, T), samples of three rows each."""
    vocab = 128 if kind.startswith("hf_") else 250 if kind == "llama_odd" else 256
    shape = (2, 3, T) if kind == "llama_units" else (2, T)
    return [torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(s))
            for s in range(first_seed, first_seed + dp)]


def attention_shape(kind: str) -> tuple[int, int, int, int]:
    """(layers, heads, K/V heads, head dim) of ``case_model(kind)``."""
    lm = case_model(kind).lm
    if kind.startswith("hf_"):
        c = lm.config
        return c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    c = lm.cfg
    return c.n_layers, c.n_heads, c.n_kv_heads, c.dim // c.n_heads


# --- dropout under context parallelism (cp_worker's "dropout" check, world 2) ------------------

DROPOUT_P = 0.5  # the embedding dropout: half the entries dropped, the most informative masks
DROPOUT_SEEDS = (11, 12)  # torch seeds of the runs: two runs from the first, one from the second


def gpt2_embedding_dropout(seed=0):
    """The tiny GPT-2 in train mode with ONLY its embedding dropout on (p = ``DROPOUT_P``; no
    residual or attention dropout): the dropout acts on (wte + wpe)[b, t], so the per-sample
    gradient of ``wpe`` row t is the mask times a gradient that is nowhere 0, and the masks
    can be read off it (an entry is exactly 0 iff it was dropped), except at the last
    position (label -100: no loss reaches it)."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=DROPOUT_P, attn_pdrop=0.0, bos_token_id=None,
                                  eos_token_id=None, tie_word_embeddings=True, attn_implementation="sdpa")
    return lf.CausalLMLoss(transformers.GPT2LMHeadModel(cfg)).train()


def assert_exact_with_clipped_sum(model: nn.Module, batch) -> dict:
    """Per-sample gradients against the torch.func oracle, then (hf_zoo's check: one noiseless
    accumulate + finalize at C = hf_zoo.CLIP) the flat-clipped sum against the oracle's. ``batch``
    is two inputs. Asserts some sample is clipped, so the clip factors are exercised. Returns the oracle's."""
    import hf_zoo

    ref = vmap_per_sample_grads(model, batch)
    assert_matches_vmap(model, batch, ref=ref)
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values()))
    assert bool((norms > hf_zoo.CLIP).any()), "the check must clip some sample"
    assert hf_zoo.error_of_ours(model, *batch, ref) < 1e-5
    return ref


# --- a failed launch's log ---------------------------------------------------------------------------

# What a rank prints when it dies in C/C++: glibc's heap checks, std::terminate, faulthandler, ASan.
_ABORT = re.compile(r"malloc\(\)|free\(\)|double free|corrupted|terminate called|Fatal Python error|"
                    r"AddressSanitizer|Segmentation fault")


def log_excerpt(text: str, tail: int = 4000) -> str:
    """The log's tail, led by the first lines that say why a rank died (a rank's abort and its
    faulthandler stack scroll out of the tail behind torchrun's report of it)."""
    found = _ABORT.search(text, 0, max(0, len(text) - tail))
    if not found:
        return text[-tail:]
    start = text.rfind("\n", 0, found.start()) + 1
    return text[start:start + 6000] + "\n[…]\n" + text[-tail:]


def rank_results(out_dir, rank: int) -> dict | None:
    """{check name: results} that rank ``rank`` of a cp_worker launch wrote into ``out_dir``
    (one file per check, in order: ``cp_worker.main``), or None where it wrote none."""
    files = sorted(Path(out_dir, f"rank{rank}").glob("*.pt"))
    return dict(torch.load(f, weights_only=False) for f in files) if files else None
