import pytest
import torch
import transformers

from longshield_fx._torch import FakeTensorMode
from longshield_fx.models import CONFIGS, Llama, LlamaConfig

from oracles import tiny_llama


def tiny_lm(**overrides):
    """The bare tiny Llama (init seed 0), in eval mode."""
    return tiny_llama(**overrides).lm.eval()


def test_shapes_and_sane_initial_loss():
    model = tiny_lm()
    ids = torch.randint(0, 256, (3, 16))
    logits = model(ids)
    assert logits.shape == (3, 16, 256)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_no_buffers():
    # Buffers would be T-dependent state or break meta/fake construction; RoPE is computed in forward.
    assert list(tiny_lm().buffers()) == []


def test_causal():
    model = tiny_lm()
    ids = torch.randint(0, 256, (2, 12))
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa(n_kv_heads):
    model = tiny_lm(n_kv_heads=n_kv_heads)
    assert model.layers[0].attention.wk.weight.shape == (n_kv_heads * 16, 64)
    assert model(torch.randint(0, 256, (2, 8))).shape == (2, 8, 256)


def test_default_position_ids_is_arange():
    model = tiny_lm()
    ids = torch.randint(0, 256, (2, 10))
    expected = model(ids)
    torch.testing.assert_close(model(ids, torch.arange(10)[None]), expected, rtol=0, atol=0)
    torch.testing.assert_close(model(ids, torch.arange(10).expand(2, 10)), expected)
    # RoPE is relative: a shift leaves logits unchanged (up to rounding), a stretch does not.
    torch.testing.assert_close(model(ids, torch.arange(10)[None] + 5), expected)
    assert not torch.allclose(model(ids, torch.arange(10)[None] * 2), expected)


def test_tied_embeddings():
    model = tiny_lm(tie_embeddings=True)
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


@pytest.mark.parametrize("name, count", [
    ("llama3.2-1b", 1_235_814_400),
    ("llama3.2-3b", 3_212_749_824),
    ("llama3.1-8b", 8_030_261_248),
])
def test_real_shapes_on_meta(name, count):
    with torch.device("meta"):
        model = Llama.from_name(name)
    assert sum(p.numel() for p in model.parameters()) == count
    assert model.cfg.rope_theta == 500000.0 and model.cfg.vocab_size == 128256


def test_8b_under_fake_tensor_mode():
    with FakeTensorMode():
        model = Llama.from_name("llama3.1-8b")
        assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
        logits = model(torch.randint(0, 128256, (1, 32)))
    assert logits.shape == (1, 32, 128256)


def test_from_name_overrides_do_not_touch_registry():
    model = Llama.from_name("tiny", n_layers=1)
    assert len(model.layers) == 1 and CONFIGS["tiny"].n_layers == 2
    assert isinstance(model.cfg, LlamaConfig)


# --- parity with Hugging Face ------------------------------------------------------------

HF_NAMES = {
    "model.embed_tokens": "tok_embeddings",
    "model.norm": "norm",
    "lm_head": "lm_head",
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}


def hf_to_ours(name):
    name = name.replace("model.layers.", "layers.")
    for hf, ours in HF_NAMES.items():
        name = name.replace(hf, ours)
    return name


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_hf_llama(tie):
    cfg = CONFIGS["tiny"]
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # random norms too, so a wrong norm mapping cannot hide behind ones
        for p in hf.parameters():
            p.normal_(0, 0.1 if p.ndim == 1 else 0.02).add_(1.0 if p.ndim == 1 else 0.0)
    ours = Llama.from_name("tiny", tie_embeddings=tie).eval()
    state = {hf_to_ours(k): v for k, v in hf.state_dict().items()}
    missing, unexpected = ours.load_state_dict(state, strict=True)
    assert not missing and not unexpected

    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)
        pos = torch.arange(24)[None] * 3 + 1000  # far, uneven positions: absolute angles must agree
        # Without an attention_mask, HF reads position jumps as packed-sequence boundaries.
        mask = torch.ones_like(ids)
        hf_logits = hf(ids, position_ids=pos, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(ours(ids, pos), hf_logits, rtol=1e-5, atol=1e-5)
