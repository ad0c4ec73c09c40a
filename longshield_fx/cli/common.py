"""What the subcommands share: the argument parser class, number types, the model flags,
printing on rank 0, building the model and the process group."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os

import torch

PROG = "longshield-fx"


class CLIError(Exception):
    """A user error: printed as one line, exit status 2, no traceback."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is ONE line on stderr (no usage block), exit status 2.
    Sub-parsers are made with the same class (argparse's default)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its actual default, "(default: X)"; a flag whose default
    is computed (None) says what it is in its own "(default: ...)" words instead."""

    def _get_help_string(self, action):
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _number(kind, minimum, strict):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


positive_int, nonneg_int = _number(int, 0, True), _number(int, 0, False)
positive_float, nonneg_float = _number(float, 0, True), _number(float, 0, False)


def add_model_args(p: argparse.ArgumentParser, seq_len_default: int) -> None:
    """The flags that decide the model and its training graph (train and inspect)."""
    from ..models import CONFIGS

    p.add_argument("--model", default="tiny", metavar="NAME|DIR",
                   help="a reference Llama shape from longshield_fx.models.CONFIGS (" + ", ".join(CONFIGS) +
                   "; 'tiny' has 131k parameters, 'small' 3.1M: on a 2-core CPU 'small' at T=2048 takes ~12 s "
                   "per step, 'tiny' does 50 steps at T=2048 in a few minutes), or a local Hugging Face model "
                   "directory (config, weights, tokenizer: what save_pretrained writes) of any causal-LM "
                   "architecture longshield_fx supports, loaded with its weights; nothing is downloaded")
    p.add_argument("--hf-config", metavar="PATH", default=None,
                   help="train a randomly initialised Hugging Face causal LM of any architecture built from this "
                   "local config JSON (its model_type; llama if absent) instead of --model; needs transformers "
                   "(default: none, --model is used)")
    p.add_argument("--seq-len", "-T", type=positive_int, default=seq_len_default, metavar="T",
                   help="tokens (bytes) per sequence; with --cp N it must be a multiple of 2*N")
    p.add_argument("--cp", type=positive_int, default=1, metavar="N",
                   help="context-parallel degree: shard each sequence over N ranks (ring attention)")
    p.add_argument("--checkpoint", choices=["none", "block", "selective"], default="none",
                   help="activation checkpointing: none, block (recompute each block in the backward) "
                   "or selective (as block, keeping attention outputs)")
    p.add_argument("--clipping", choices=["flat", "per_layer", "automatic"], default="flat",
                   help="per-sample clipping: one norm over all parameters, one per parameter (C/sqrt(K) "
                   "each), or automatic (C/(|g|+0.01))")
    p.add_argument("--max-grad-norm", "-C", type=positive_float, default=1.0, metavar="C",
                   help="clipping threshold C")
    p.add_argument("--physical-batch-size", type=positive_int, default=None, metavar="B",
                   help="rows per compiled step (the graph's fixed batch dimension)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the model initialisation and dropout ONLY (inspect: also its random batch). The "
                   "DP noise and the Poisson sampling never use it: they come from ChaCha20 streams keyed by "
                   "256 bits from the OS, so two runs with the same --seed start from the same model but draw "
                   "different batches and noise")


# --- rank 0 prints ----------------------------------------------------------------------------

_RANK = [0]  # this process's rank once the process group exists


def rank() -> int:
    return _RANK[0]


def say(*args, **kwargs):
    if _RANK[0] == 0:
        print(*args, **kwargs, flush=True)


# --- model and processes ----------------------------------------------------------------------

def check_seq_len(args):
    if args.seq_len < 2:
        raise CLIError(f"--seq-len must be >= 2 (a next-token loss needs two tokens), got {args.seq_len}")
    hp = getattr(args, "hp", 1)
    if args.seq_len % (2 * args.cp * hp):
        what = "2*cp" if hp == 1 else "2*cp*hp"
        cut = f", cut into {hp} head-parallel pieces" if hp > 1 else ""
        raise CLIError(f"--seq-len {args.seq_len} is not a multiple of {what} = {2 * args.cp * hp} (each of the "
                       f"{args.cp} context-parallel ranks holds two zig-zag chunks{cut})")


def check_model_flags(args) -> None:
    """Fail fast on --model / --hf-config, before processes, data and compilation."""
    from ..models import CONFIGS
    from . import hf

    if args.hf_config:
        if args.model != "tiny":
            raise CLIError("pass either --model or --hf-config, not both")
        hf.load_config_json(args.hf_config)
    elif args.model not in CONFIGS:
        if not hf.is_model_dir(args.model):
            raise CLIError(f"--model {args.model}: neither a reference model name ({', '.join(CONFIGS)}) nor a "
                           "directory")
        hf.check_model_dir(args.model)


def pretrained(args) -> bool:
    """--model names a Hugging Face model directory (its weights and tokenizer are used)."""
    from ..models import CONFIGS

    return not args.hf_config and args.model not in CONFIGS


def build_model(args, byte_level: bool = True):
    """(CausalLMLoss model, model description for the signature, display name). ``byte_level``:
    the data are bytes (the embedded corpus), so the vocabulary must hold 256 tokens."""
    import longshield_fx as lf

    from . import hf

    if args.hf_config:
        lm, desc, name = hf.random_model(hf.load_config_json(args.hf_config), args.seed, args.hf_config)
    elif pretrained(args):
        torch.manual_seed(args.seed)  # dropout's RNG only: the weights are loaded
        lm, desc, name = hf.pretrained_model(args.model)
    else:
        from ..models import CONFIGS, Llama

        torch.manual_seed(args.seed)
        lm = Llama.from_name(args.model)
        return lf.CausalLMLoss(lm), {"kind": "llama", "name": args.model, **dataclasses.asdict(CONFIGS[args.model])}, \
            f"Llama {args.model!r}"
    if byte_level:
        hf.check_byte_vocab(lm, "--model" if pretrained(args) else "--hf-config")
    return lf.CausalLMLoss(lm), desc, name


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _attempt_store(timeout) -> dict:
    """Under torchrun's shared rendezvous store: ``init_process_group`` arguments for a store of
    this restart attempt's own. The store outlives a failed attempt (torchrun's agent hosts it),
    and without a prefix a relaunched rank can read the dead attempt's addresses and fail in gloo's
    connectFullMesh with "Connection refused" (pytorch/pytorch#135712, #167288)."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"longshield_fx/attempt_{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def setup_distributed(cp: int, device: str, command: str):
    """(mesh or None, dp, dp_rank). Inits the default process group under torchrun."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .._torch import serial_gloo

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        if cp > 1:
            raise CLIError(f"--cp {cp} needs {cp} processes: torchrun --standalone --nproc-per-node {cp} "
                           f"-m longshield_fx {command} --cp {cp} ...")
        return None, 1, 0
    if world % cp:
        raise CLIError(f"--cp {cp} does not divide the world size {world} (torchrun --nproc-per-node)")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(minutes=10)
    backend = "nccl" if device == "cuda" else serial_gloo()  # one worker thread: see _torch.serial_gloo
    dist.init_process_group(backend, timeout=timeout, **_attempt_store(timeout))
    _RANK[0] = dist.get_rank()
    dp = world // cp
    if dp > 1:
        mesh = init_device_mesh(device, (dp, cp), mesh_dim_names=("dp", "cp"))
        return mesh, dp, mesh["dp"].get_local_rank()
    return init_device_mesh(device, (cp,), mesh_dim_names=("cp",)), 1, 0
