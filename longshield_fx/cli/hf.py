"""Hugging Face models in the CLI: a local pretrained directory (``--model DIR``), a randomly
initialised model of any causal-LM architecture from a config JSON (``--hf-config``), LoRA
adapters (``--lora``, with the optional ``peft`` package) and the trained model written back
in Hugging Face format (``--out/model/``).

Nothing is downloaded: every load passes ``local_files_only=True``. transformers and peft are
imported here only, when a flag asks for them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .common import CLIError

# Config keys that say where or with which library version a config was written, not what
# the model is: left out of the run signature so a copied model directory still resumes.
_VOLATILE = {"transformers_version", "_name_or_path", "architectures", "id2label", "label2id",
             "_attn_implementation_autoset", "dtype", "torch_dtype"}


def _transformers(flag: str):
    try:
        import transformers
    except ImportError:
        raise CLIError(f"{flag} needs the transformers package: pip install transformers") from None
    transformers.logging.set_verbosity_error()  # its load reports are not ours to print
    return transformers


def is_model_dir(value: str) -> bool:
    return Path(value).is_dir()


def check_model_dir(path: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise CLIError(f"--model {path}: not a Hugging Face model directory (no config.json in it); pass a "
                       "directory written by save_pretrained, or a reference model name")
    return p


def describe_config(cfg) -> dict:
    return {k: v for k, v in json.loads(cfg.to_json_string(use_diff=False)).items() if k not in _VOLATILE}


def load_config_json(path: str):
    """A config of any architecture from a JSON file (``model_type`` names it; "llama" if absent)."""
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"--hf-config: no such file: {path}")
    transformers = _transformers("--hf-config")
    try:
        fields = json.loads(p.read_text())
        if not isinstance(fields, dict):
            raise ValueError("the file does not hold a JSON object")
        model_type = fields.pop("model_type", "llama")
        return transformers.AutoConfig.for_model(model_type, **fields)
    except (OSError, ValueError, KeyError) as e:
        raise CLIError(f"--hf-config: cannot read a model config from {path}: {' '.join(str(e).split())}") from None


def _causal_lm(make, what: str):
    """``make(attn_implementation)``: SDPA attention where the architecture has it, else eager."""
    try:
        return make("sdpa")
    except ValueError as e:
        if "sdpa" not in str(e).lower():
            raise CLIError(f"{what}: {' '.join(str(e).split())}") from None
        return make("eager")


def random_model(cfg, seed: int, path: str):
    """A randomly initialised causal LM of ``cfg``'s architecture (model init seeded by ``seed``)."""
    transformers = _transformers("--hf-config")
    torch.manual_seed(seed)
    lm = _causal_lm(lambda attn: transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn),
                    f"--hf-config {path}")
    return lm, {"kind": "hf_random", **describe_config(cfg)}, f"HF {type(lm).__name__} ({path}, random init)"


def pretrained_model(path: str):
    """The causal LM of a local model directory, weights loaded in fp32."""
    transformers = _transformers("--model DIR")
    p = check_model_dir(path)

    def make(attn):
        return transformers.AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=torch.float32,
                                                                  attn_implementation=attn)
    try:
        lm = _causal_lm(make, f"--model {path}")
    except (OSError, KeyError) as e:
        raise CLIError(f"--model {path}: cannot load a causal LM from it: {' '.join(str(e).split())}") from None
    desc = {"kind": "hf_pretrained", "path": str(p.resolve()), **describe_config(lm.config)}
    return lm, desc, f"HF {type(lm).__name__} ({path})"


def load_tokenizer(path: str):
    transformers = _transformers("--model DIR")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise CLIError(f"--model {path}: no usable tokenizer in it ({' '.join(str(e).split())}); save one with "
                       "tokenizer.save_pretrained(DIR)") from None
    tok.model_max_length = 1 << 62  # documents are cut into rows after encoding: no length warning
    return tok


def tokenizer_encoder(tok):
    """(encode(text) -> ids, pad id). Special tokens (e.g. BOS) as the tokenizer adds them."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return (lambda text: tok(text, add_special_tokens=True)["input_ids"]), (0 if pad is None else int(pad))


def check_byte_vocab(lm, flag: str) -> None:
    vocab = lm.get_input_embeddings().num_embeddings
    if vocab < 256:
        raise CLIError(f"{flag}: the model's vocabulary has {vocab} tokens, but the embedded corpus is byte-level "
                       "(256 tokens); pass --data with the model's own tokenizer, or a larger vocab_size")


# --- LoRA -----------------------------------------------------------------------------------

def require_peft():
    try:
        import peft
    except ImportError:
        raise CLIError("--lora needs the peft package: pip install peft (or pip install 'longshield_fx[hf]')") \
            from None
    return peft


def add_lora(lm, rank: int, alpha: float | None, targets: str):
    """``lm`` with LoRA adapters (peft): only the adapters are trainable, so only they are
    clipped, noised and stepped."""
    peft = require_peft()
    target = "all-linear" if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha, target_modules=target,
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(lm, config)
    except ValueError as e:
        raise CLIError(f"--lora-targets {targets}: {' '.join(str(e).split())}") from None


def lora_description(args) -> dict | None:
    if not args.lora:
        return None
    return {"r": args.lora, "alpha": 2 * args.lora if args.lora_alpha is None else args.lora_alpha,
            "targets": args.lora_targets}


# --- output ---------------------------------------------------------------------------------

def save_hf_model(lm, tokenizer, folder: Path, lora_save: str) -> str:
    """``lm`` (a transformers model or a peft one) in Hugging Face format, safetensors weights.
    A LoRA model is saved merged into its base (loadable without peft) or as a peft adapter.
    Merging happens on a copy: the in-memory model stays as trained. Returns what was saved."""
    import copy

    folder.mkdir(parents=True, exist_ok=True)
    what = "the full model"
    if hasattr(lm, "merge_and_unload"):
        if lora_save == "adapter":
            lm.save_pretrained(folder)
            what = "the LoRA adapter (load with peft.AutoPeftModelForCausalLM.from_pretrained)"
        else:
            copy.deepcopy(lm).merge_and_unload().save_pretrained(folder)
            what = "the model with its LoRA adapters merged in"
    else:
        lm.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return what
