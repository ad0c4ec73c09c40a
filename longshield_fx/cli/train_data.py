"""What ``longshield-fx train`` trains on: the user's documents (--data, held-out --eval-*)
and the model (a reference Llama, --hf-config, or a pretrained --model DIR, with --lora).
The embedded corpus stays in ``corpus.py``."""
from __future__ import annotations

import hashlib
from pathlib import Path

from .corpus import NOT_COVERED
from .common import CLIError, positive_float, positive_int
from .models import build_model, check_positions, pretrained, require_peft


def add_data_args(p) -> None:
    p.add_argument("--data", metavar="PATH", default=None,
                   help="your documents: a directory of UTF-8 text files (one document each; binary files, not "
                   "UTF-8 or mostly NUL or control bytes, are skipped, counted and named), a .jsonl file (a 'text' field per line; an optional 'id' field names the "
                   "privacy unit, e.g. a patient: documents sharing an id are sampled and clipped together) or a "
                   ".txt file (one document per line); tokenized with the model's tokenizer (bytes for --model NAME "
                   "and --hf-config) (default: none, the embedded stdlib corpus)")
    p.add_argument("--unit-key", type=_unit_key, default="id", metavar="KEY",
                   help="the .jsonl field naming the privacy unit (a person, a patient): lines sharing its value "
                   "are one unit; every line must have it, or none (then each line is its own unit); 'none': each "
                   "line its own unit whatever its fields. Values are compared after Unicode NFKC, case folding, "
                   "removing invisible characters and collapsing whitespace ('5' and '05' stay two units); lines "
                   "without it but with an id-like or person-like field (user_id, author, email, ...) are refused")
    p.add_argument("--max-rows", type=positive_int, default=8, metavar="R",
                   help="rows of T tokens per privacy unit: a longer unit is cut after R rows (reported); every "
                   "unit is padded to the longest unit's rows, at most R")
    p.add_argument("--no-pack", action="store_true",
                   help="keep each privacy unit in R padded rows of its own (--max-rows) instead of packing several "
                   "units' rows into each row of a physical batch of at most B·R rows (the default with --data: "
                   "far less padding; each unit is still one sample, clipped alone, and no token attends across "
                   "units), also over --cp, data-parallel ranks and --fsdp")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--eval-data", metavar="PATH", default=None,
                   help="held-out documents (same formats as --data) evaluated during training (default: none)")
    g.add_argument("--eval-fraction", type=positive_float, default=None, metavar="F",
                   help="hold out this fraction of the --data units (a --seed shuffle) for evaluation; they are "
                   "never trained on (default: none)")
    p.add_argument("--eval-every", type=positive_int, default=10, metavar="K",
                   help="evaluate the held-out loss and perplexity every K steps and at the end")
    p.add_argument("--lora", type=positive_int, default=None, metavar="R",
                   help="train LoRA adapters of rank R (peft) instead of every weight: only the adapters are "
                   "clipped, noised and stepped; Hugging Face models only (default: none, full fine-tuning)")
    p.add_argument("--lora-alpha", type=positive_float, default=None, help="LoRA scaling alpha (default: 2R)")
    p.add_argument("--lora-targets", default="all-linear", metavar="NAMES",
                   help="comma-separated module names to adapt (e.g. q_proj,v_proj), or all-linear (every linear "
                   "layer but the output head)")
    p.add_argument("--lora-save", choices=["merged", "adapter"], default="merged",
                   help="how --out/model/ holds a LoRA model: merged into the base weights (loads without peft) or "
                   "as a peft adapter")


def _unit_key(text: str) -> str | None:
    return None if text.strip().lower() == "none" else text


def check_data_args(args) -> None:
    """Fail fast on the data, evaluation and LoRA flags, before processes and data."""
    if pretrained(args) and not args.data:
        raise CLIError(f"--model {args.model} is a pretrained model: pass --data PATH (your documents, tokenized with "
                       "its tokenizer); the embedded corpus is byte-level")
    if (args.eval_data or args.eval_fraction) and not args.data:
        raise CLIError("--eval-data/--eval-fraction need --data (the embedded corpus has no held-out split)")
    if args.eval_fraction is not None and not args.eval_fraction < 1:
        raise CLIError(f"--eval-fraction must be < 1, got {args.eval_fraction:g}")
    if args.lora and not (args.hf_config or pretrained(args)):
        raise CLIError("--lora adapts Hugging Face models: pass --model DIR or --hf-config")
    if args.lora:
        require_peft()


def load_documents_for(job):
    """(training Documents, held-out Documents or None), tokenized with the model's tokenizer."""
    from . import models
    from ..documents import load_documents

    args = job.args
    if pretrained(args):
        job.tokenizer = models.load_tokenizer(args.model)
        encode, pad = models.tokenizer_encoder(job.tokenizer)
    else:
        encode, pad = (lambda text: list(text.encode("utf-8"))), 0  # byte-level, as the embedded corpus

    def load(path):
        return load_documents(path, encode, args.seq_len, args.max_rows, pad, args.unit_key)

    docs = load(args.data)
    if docs.unit_key is not None:
        job.unit = (f"per unit: every document sharing one {docs.unit_key!r} (compared after NFKC, case folding, "
                    "removing invisible characters and collapsing whitespace; add/remove one unit)")
    if args.eval_fraction:
        return docs.split(args.eval_fraction, args.seed)
    return docs, load(args.eval_data) if args.eval_data else None


def build_model_for(job) -> None:
    """The model (the only use of --seed: init and dropout's RNG), with LoRA adapters if asked."""
    import longshield_fx as lf

    args = job.args
    job.model, job.model_desc, job.model_name = build_model(args, byte_level=job.tokenizer is None)
    if args.lora:
        from .models import add_lora, lora_description

        job.model = lf.CausalLMLoss(add_lora(job.model.lm, args.lora, args.lora_alpha, args.lora_targets))
        job.model_desc = {**job.model_desc, "lora": lora_description(args)}
        job.model_name += f" + LoRA r={args.lora} ({args.lora_targets})"
    job.model.train()  # from_pretrained returns a model in eval mode: fine-tuning runs dropout as configured
    check_positions(job.model, args.seq_len)


def data_signature(job) -> dict:
    """The data a checkpoint must have been trained on: the flags in the clear, the data path as a
    hash, and the counts read from the data under ``not_covered_by_dp``."""
    args = job.args
    if not args.data:
        return {"unit": "document", "max_files": args.max_files,
                NOT_COVERED: {"documents": job.corpus.num_units}}
    return {"unit": job.unit, "data_path_sha256": hashlib.sha256(str(Path(args.data).resolve()).encode()).hexdigest(),
            "max_rows": args.max_rows, "unit_key": args.unit_key,
            "layout": "packed" if job.packed else "padded rows", "eval_fraction": args.eval_fraction,
            "split_seed": args.seed if args.eval_fraction else None,
            NOT_COVERED: {"units": job.corpus.num_units, "rows_per_unit": job.corpus.rows_per_unit}}
