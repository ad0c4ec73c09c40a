"""What the subcommands share: the argument parser class, number types, the model flags,
printing on rank 0 and the process group. Building the model is ``models.py``'s."""
from __future__ import annotations

import argparse
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
EXPECTED_BATCH_SIZE = 8.0  # train's default E[units] per logical batch, which inspect --packed takes too


def add_model_args(p: argparse.ArgumentParser, seq_len_default: int) -> None:
    """The flags that decide the model and its training graph (train and inspect)."""
    from ..models import CONFIGS

    p.add_argument("--model", default="tiny", metavar="NAME|DIR",
                   help="a reference Llama shape from longshield_fx.models.CONFIGS (" + ", ".join(CONFIGS) +
                   f"; 'tiny' has 131k parameters and positions for T <= {CONFIGS['tiny'].max_seq_len}, 'small' "
                   f"3.1M and T <= {CONFIGS['small'].max_seq_len}; a longer -T is warned about; the default "
                   "'train' run's time on a 2-core CPU: docs/getting-started.md), or a local Hugging Face model "
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
