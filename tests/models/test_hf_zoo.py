"""Every causal-LM architecture of the installed transformers on a tiny config (tests/hf_zoo.py):
exact against a per-sample autograd loop, or refused for a reason that is a real
sample-mixing op. The README's table is this run's table."""
import re
from pathlib import Path

import pytest
import torch
import transformers

import longshield_fx as lf
from longshield_fx.errors import UnsupportedModelError

import hf_zoo
from oracles import vmap_per_sample_grads

MODELS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"

# Refusals we stand by: the op really works across the samples of the batch. None now: JetMoE's
# expert counts over the batch's tokens only sized its sort-and-group dispatch (no capacity limit,
# so no token depended on another's routing); its capture runs a fixed-shape stand-in
# (longshield_fx/_fixed_shape_forwards.py) and is exact.
REAL_MIXING: dict[str, str] = {}
# Refusals that are gaps of ours, each with the message it must keep until fixed (the test
# then asks for the entry to go): not sample mixing, but not exact either.
KNOWN_GAPS: dict[str, str] = {}


@pytest.fixture(scope="module")
def zoo(distributed):
    """Every architecture's outcome, from the background run of tests/hf_zoo.py (its own process,
    whose address space is capped so a giant default sub-config fails to build, not the machine)."""
    return {n: hf_zoo.Outcome(**o) for n, o in distributed.zoo().items()}


@pytest.mark.hf_zoo
def test_every_architecture_is_exact_or_refused_for_mixing(zoo):
    expected = {**REAL_MIXING, **KNOWN_GAPS}
    bad = {n: o for n, o in zoo.items() if o.status in ("wrong", "crash")
           or o.status == "refused" and expected.get(n, "\0") not in o.detail}
    assert not bad, "\n".join(f"{n}: {o.status}: {o.detail}" for n, o in bad.items())
    fixed = [n for n in expected if zoo[n].status != "refused"]
    assert not fixed, f"now {[(n, zoo[n].status) for n in fixed]}: remove them from REAL_MIXING / KNOWN_GAPS"


@pytest.mark.hf_zoo
def test_at_least_90_percent_of_the_buildable_architectures_are_exact(zoo):
    built = [o for o in zoo.values() if o.status != "no tiny config"]
    exact = [o for o in built if o.status == "exact"]
    assert len(built) >= 60, len(built)
    assert len(exact) >= 0.9 * len(built), f"{len(exact)} of {len(built)} exact"


@pytest.mark.hf_zoo
def test_readme_shows_this_table(zoo):
    """Row for row, the README's architecture -> outcome (error digits and the wording of
    build failures left aside: they vary with BLAS and machine)."""
    text = MODELS_PAGE.read_text()
    start = text.index("| architecture | result |")
    shown = text[start:text.index("\n\n", start)]

    def outcomes(table):
        rows = [line.split(" | ", 1) for line in table.splitlines()[2:]]
        return {name.strip("| "): re.sub(r"^(exact|no tiny config).*", r"\1", result.strip(" |"))
                for name, result in rows}

    assert outcomes(shown) == outcomes(hf_zoo.table(zoo)), "regenerate it: python tests/hf_zoo.py --table"


def test_blt_with_entropy_patching_is_refused_at_capture():
    """BLT's default patching draws patch boundaries from its entropy model's predictions on the
    batch (through torch.distributions.Categorical, which dynamo's export capture does not trace):
    the graph's shapes would depend on the data. The zoo runs BLT with static patching
    (``hf_zoo.OVERRIDES``); this is the refusal its default gets, by name."""
    model = hf_zoo.build("blt", hf_zoo.layers_needed("blt"))
    model.lm.config.patching_mode = "entropy"
    ids, labels = hf_zoo.batch()
    with pytest.raises(lf.UnsupportedModelError, match="cannot be traced into one graph"):
        lf.compile(model).per_sample_grads(ids, labels)


# --- beyond causal LMs: sequence classification and LoRA ---------------------------------

class PerSampleCrossEntropy(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        logits = self.model(ids).logits
        return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")


def _classifier(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=hf_zoo.VOCAB, hidden_size=32, intermediate_size=64, num_labels=3,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       pad_token_id=0, attn_implementation="sdpa")
        return transformers.LlamaForSequenceClassification(cfg)
    cfg = transformers.BertConfig(vocab_size=hf_zoo.VOCAB, hidden_size=32, intermediate_size=64, num_labels=3,
                                  num_hidden_layers=2, num_attention_heads=4, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return transformers.BertForSequenceClassification(cfg)


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_sequence_classification_is_exact(kind):
    model = PerSampleCrossEntropy(_classifier(kind)).eval()
    ids = torch.randint(1, hf_zoo.VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
    ids[1, 7:] = 0  # a padded row: Llama pools its last non-pad token
    labels = torch.tensor([0, 2, 1])
    ref = hf_zoo.loop_per_sample_grads(model, ids, labels)
    assert hf_zoo.error_of_ours(model, ids, labels, ref) <= 1e-5  # per-sample grads and the clipped sum


def test_lora_llama_trains_only_the_adapters_exactly():
    import peft
    lm = hf_zoo.build("llama").lm
    lora = peft.get_peft_model(lm, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model = lf.CausalLMLoss(lora).eval()
    ids, labels = hf_zoo.batch()
    ours = lf.compile(model).per_sample_grads(ids, labels)
    assert ours and all("lora_" in n for n in ours)
    ref = hf_zoo.loop_per_sample_grads(model, ids, labels)
    assert hf_zoo.error_of_ours(model, ids, labels, ref) <= 1e-5  # per-sample grads and the clipped sum
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


class LoRALinear(torch.nn.Module):
    """A minimal LoRA adapter: the frozen base plus a trainable low-rank update B·A."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def test_minimal_lora_adapter_on_llama_is_exact():
    model = hf_zoo.build("llama").requires_grad_(False)
    for layer in model.lm.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
    ids, labels = hf_zoo.batch()
    ours = lf.compile(model).per_sample_grads(ids, labels)
    assert sorted(ours) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert hf_zoo.relative_error(ours, vmap_per_sample_grads(model, (ids, labels))) <= 1e-5


def test_batch_level_moe_load_balancing_loss_is_refused():
    """Mixtral's load-balancing loss counts routing over every token of the batch, so each
    sample's loss would depend on the others: refused, naming the op. (CausalLMLoss trains
    without it: the router is trained through the routing weights alone.)"""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    model = hf_zoo.build("mixtral")

    class WithAuxLoss(torch.nn.Module):
        def __init__(self, loss):
            super().__init__()
            self.loss = loss

        def forward(self, ids, labels):
            hidden = self.loss.lm.model.embed_tokens(ids)
            router = self.loss.lm.model.layers[0].mlp.gate
            logits, _, _ = router(hidden)
            aux = load_balancing_loss_func((logits,), router.num_experts, router.top_k)
            return self.loss(ids, labels) + 0.01 * aux  # the batch's aux loss on every sample

    with pytest.raises(UnsupportedModelError, match="histc.*mixes samples: a histogram counts.*Way out: if it is an MoE "
                       "load-balancing loss, train without it"):
        lf.compile(WithAuxLoss(model)).per_sample_grads(*hf_zoo.batch())


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_moe_experts_of_any_implementation_are_captured_as_batched_mm_and_exact(implementation):
    """transformers' default ``grouped_mm`` sorts the batch's tokens by expert and ``eager`` loops
    over the experts hit (no static graph); the capture runs ``batched_mm``, the same sums in
    fixed shapes, and leaves the model's own choice as it was."""
    cfg = hf_zoo.tiny_config("mixtral")
    cfg._experts_implementation = implementation
    torch.manual_seed(0)
    model = lf.CausalLMLoss(transformers.AutoModelForCausalLM.from_config(cfg))
    ids, labels = hf_zoo.batch()
    ref = hf_zoo.loop_per_sample_grads(model, ids, labels)
    assert hf_zoo.error_of_ours(model, ids, labels, ref) <= 1e-5
    assert cfg._experts_implementation == implementation
