"""The model a subcommand trains or inspects: a reference Llama by name (``--model tiny``), or a
Hugging Face one: a local pretrained directory (``--model DIR``), a randomly
initialised model of any causal-LM architecture from a config JSON (``--hf-config``), LoRA
adapters (``--lora``, with the optional ``peft`` package) and the trained model written back
in Hugging Face format (``--out/model/``).

Nothing is downloaded: every load passes ``local_files_only=True``. transformers and peft are
imported here only, when a flag asks for them.
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch

from .common import CLIError, say

# Config keys that say where or with which library version a config was written, not what
# the model is: left out of the run signature so a copied model directory still resumes.
_VOLATILE = {"transformers_version", "_name_or_path", "architectures", "id2label", "label2id",
             "_attn_implementation_autoset", "dtype", "torch_dtype"}


def check_model_flags(args) -> None:
    """Fail fast on --model / --hf-config, before processes, data and compilation."""
    from ..models import CONFIGS

    if args.hf_config:
        if args.model != "tiny":
            raise CLIError("pass either --model or --hf-config, not both")
        load_config_json(args.hf_config)
    elif args.model not in CONFIGS:
        if not is_model_dir(args.model):
            raise CLIError(f"--model {args.model}: neither a reference model name ({', '.join(CONFIGS)}) nor a "
                           "directory")
        check_model_dir(args.model)


def pretrained(args) -> bool:
    """--model names a Hugging Face model directory (its weights and tokenizer are used)."""
    from ..models import CONFIGS

    return not args.hf_config and args.model not in CONFIGS


def build_model(args, byte_level: bool = True):
    """(CausalLMLoss model, model description for the signature, display name). ``byte_level``:
    the data are bytes (the embedded corpus), so the vocabulary must hold 256 tokens."""
    import longshield_fx as lf

    if args.hf_config:
        lm, desc, name = random_model(load_config_json(args.hf_config), args.seed, args.hf_config)
    elif pretrained(args):
        torch.manual_seed(args.seed)  # dropout's RNG only: the weights are loaded
        lm, desc, name = pretrained_model(args.model)
    else:
        from ..models import CONFIGS, Llama

        torch.manual_seed(args.seed)
        lm = Llama.from_name(args.model)
        return lf.CausalLMLoss(lm), {"kind": "llama", "name": args.model, **dataclasses.asdict(CONFIGS[args.model])}, \
            f"Llama {args.model!r}"
    if byte_level:
        check_byte_vocab(lm, "--model" if pretrained(args) else "--hf-config")
    return lf.CausalLMLoss(lm), desc, name


def check_positions(model, T: int) -> None:
    """A sequence longer than the model's positions: refused where the positions are a learned table
    (GPT-2's ``wpe``: position T-1 has no row), a warning where they are computed (RoPE runs past
    ``max_position_embeddings``, but the model was never trained there; the reference Llama's
    ``max_seq_len`` alike)."""
    import torch.nn as nn

    from ..models import LlamaConfig

    lm = getattr(model, "lm", model)
    if isinstance(getattr(lm, "cfg", None), LlamaConfig):  # the reference Llama: RoPE, computed positions
        if lm.cfg.max_seq_len < T:
            say(f"WARNING: --seq-len {T} is longer than the reference model's max_seq_len = {lm.cfg.max_seq_len}: its "
                "positions are computed (they run on), but the shape is meant for sequences up to it")
        return
    config = getattr(lm, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not isinstance(limit, int) or limit >= T:
        return
    learned = [n for n, m in lm.named_modules() if isinstance(m, nn.Embedding) and ("pos" in n.lower() or n.endswith("wpe"))]
    if learned:
        raise CLIError(f"--seq-len {T} is longer than the model's {limit} learned positions ({learned[0]}); "
                       f"use --seq-len {limit} or less")
    say(f"WARNING: --seq-len {T} is longer than the model's max_position_embeddings = {limit}: its positions are "
        "computed (they run on), but it was never trained beyond them")


def import_transformers(flag: str):
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
    transformers = import_transformers("--hf-config")
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
    transformers = import_transformers("--hf-config")
    torch.manual_seed(seed)
    lm = _causal_lm(lambda attn: transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn),
                    f"--hf-config {path}")
    return lm, {"kind": "hf_random", **describe_config(cfg)}, f"HF {type(lm).__name__} ({path}, random init)"


def pretrained_model(path: str):
    """The causal LM of a local model directory, weights loaded in fp32."""
    transformers = import_transformers("--model DIR")
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
    transformers = import_transformers("--model DIR")
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
        raise CLIError("--lora needs the peft package: pip install peft (or pip install -e '.[hf]' in the repository)") \
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
        with warnings.catch_warnings():
            # transformers 5 renamed PreTrainedModel.is_gradient_checkpointing to is_activation_checkpointing,
            # keeping the old name as a FutureWarning alias until v6; peft (0.21) still reads the old name
            # in PeftModel.__init__, so every --lora run printed the warning.
            warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning, module=r"transformers\.modeling_utils")
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
