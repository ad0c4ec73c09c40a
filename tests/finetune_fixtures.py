"""A pretrained-style Hugging Face model directory and private documents, built on the fly:
a BPE tokenizer trained with ``tokenizers`` on the documents' own text, a tiny Llama saved
with ``save_pretrained`` (random, or first trained non-privately for a few steps)."""
from __future__ import annotations

import random
from pathlib import Path

import torch

_NAMES = "ada bo cy dee eli fay gus hal ivy jo kai lu mo ned ola pia".split()
_PARTS = "knee elbow wrist ankle hip shoulder neck back".split()
_SYMPTOMS = "pain swelling stiffness numbness weakness".split()
_PLANS = "rest and ice|physiotherapy twice a week|an x-ray|review in two weeks|anti-inflammatories".split("|")


def record(rng: random.Random) -> str:
    """One visit note: a fixed template, so that a few steps of training learn its structure."""
    return (f"patient {rng.choice(_NAMES)} age {rng.randint(20, 90)} reports {rng.choice(_SYMPTOMS)} in the "
            f"{rng.choice(['left', 'right'])} {rng.choice(_PARTS)}. plan: {rng.choice(_PLANS)}.\n")


def documents(n: int, seed: int) -> list[str]:
    """n multi-record documents (3 to 9 visit notes each, i.e. several rows at T = 64)."""
    rng = random.Random(seed)
    return ["".join(record(rng) for _ in range(rng.randint(3, 9))) for _ in range(n)]


def write_folder(folder: Path, texts: list[str]) -> Path:
    folder.mkdir(parents=True)
    for i, text in enumerate(texts):
        (folder / f"visit-{i:03d}.txt").write_text(text)
    return folder


def tokenizer(texts: list[str]):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")


def tiny_llama(vocab: int, seed: int = 0):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def pretrain(lm, tok, texts: list[str], steps: int, T: int = 64, lr: float = 1e-2, seed: int = 0) -> None:
    """Non-private warm start: AdamW on T-token chunks of ``texts``, batch 8."""
    ids = [t for text in texts for t in tok(text)["input_ids"]]
    chunks = torch.tensor(ids[: len(ids) // T * T]).view(-1, T)
    opt = torch.optim.AdamW(lm.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    lm.train()
    for _ in range(steps):
        batch = chunks[torch.randint(0, len(chunks), (8,), generator=g)]
        lm(batch, labels=batch, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    lm.eval()


def save(lm, tok, folder: Path) -> Path:
    lm.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
