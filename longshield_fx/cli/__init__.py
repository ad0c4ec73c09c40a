"""``longshield-fx``: command-line entry points (``train``, ``inspect``).

``longshield-fx train`` trains a causal LM with DP-SGD on an embedded long-document corpus:
this machine's Python standard library sources, read as bytes (a byte-level vocabulary of
256) and treated as a private codebase. Nothing is downloaded. Under ``torchrun`` with
``--cp N`` the same job runs context-parallel (gloo on CPU, NCCL on GPU).

Privacy, as the CLI applies it: the unit is the document (one stdlib file = one row: its
first T bytes, padding labelled -100; truncation is reported), so the printed ε is per
document (add/remove one document), at δ = min(1e-5, N^-1.1) by default, PLD accountant.
``--seed`` seeds the model initialisation (and dropout) only; the noise and the Poisson
sampling come from secret ChaCha20 streams keyed by the OS (``--insecure-seed`` is a test-only
escape hatch that voids the guarantee). Losses, timings, batch sizes and counts are not covered by ε
and are written only under ``not_covered_by_dp``. Checkpoints (``checkpoints/ckpt-*.pt``) are
SECRET: they hold the noise key and the sampling key.

``longshield-fx inspect`` builds the training graph for one batch and shows what the passes
did: node counts, the per-sample rule of every parameter, the inserted collectives and their
bytes, and one transformer block's rewritten graph as SVG.

``python -m longshield_fx`` is the same program.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

import torch

PROG = "longshield-fx"
CHECKPOINT_FORMAT = 2  # 2: secret noise and sampling streams, one row per document
_CKPT_RE = re.compile(r"^ckpt-(\d{8})\.pt$")


class CLIError(Exception):
    """A user error: printed as one line, exit status 2, no traceback."""


# --- corpus ---------------------------------------------------------------------------------

def stdlib_files(max_files: int | None = None) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    return files[:max_files] if max_files else files


@dataclasses.dataclass
class Corpus:
    """One row per document (a stdlib file): the privacy unit is the document.

    ``ids`` (N, T) holds each document's first T bytes, padded with byte 0; ``labels`` is
    ``ids`` with -100 at the padding, so padding positions contribute 0 to ``CausalLMLoss``
    (causal attention: the padding after a document never reaches its real tokens). A
    document is therefore sampled as one row and clipped as one sample, whatever its length;
    bytes past T are not used (``truncated`` documents, ``bytes_used`` of ``bytes_total``).
    """

    ids: torch.Tensor
    labels: torch.Tensor
    lengths: list[int]  # bytes of each document (before truncation)
    seq_len: int
    skipped: int  # files with fewer than 2 bytes (no next-token pair): not in the corpus

    @property
    def num_documents(self) -> int:
        return len(self.lengths)

    @property
    def truncated(self) -> int:
        return sum(n > self.seq_len for n in self.lengths)

    @property
    def bytes_total(self) -> int:
        return sum(self.lengths)

    @property
    def bytes_used(self) -> int:
        return sum(min(n, self.seq_len) for n in self.lengths)

    @property
    def fraction_used(self) -> float:
        return self.bytes_used / self.bytes_total

    def dataset(self):
        from torch.utils.data import TensorDataset

        return TensorDataset(self.ids, self.labels)

    def stats(self) -> dict:
        return {"documents": self.num_documents, "truncated_documents": self.truncated,
                "bytes_used": self.bytes_used, "bytes_total": self.bytes_total,
                "bytes_used_fraction": round(self.fraction_used, 6), "skipped_files_under_2_bytes": self.skipped}


def stdlib_corpus(seq_len: int, max_files: int | None = None) -> Corpus:
    """One row per standard-library .py file (sorted by path): its first ``seq_len`` bytes,
    padded (label -100) when shorter. Files of fewer than 2 bytes are left out."""
    rows, lengths, skipped = [], [], 0
    for f in stdlib_files(max_files):
        data = f.read_bytes()
        if len(data) < 2:
            skipped += 1
            continue
        lengths.append(len(data))
        rows.append(data[:seq_len])
    if not rows:
        raise CLIError("the corpus has no document of 2 bytes or more; raise --max-files")
    ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), -100, dtype=torch.long)
    for i, data in enumerate(rows):
        row = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        ids[i, :len(data)] = row
        labels[i, :len(data)] = row
    return Corpus(ids, labels, lengths, seq_len, skipped)


def default_delta(num_documents: int) -> float:
    """δ = min(1e-5, N^-1.1): well below 1/N (Ponomareva et al. 2023, "How to DP-fy ML",
    recommend δ ≪ 1/N), so a mechanism that releases one whole record with probability δ
    leaks far less than one record in expectation (N·δ ≤ N^-0.1)."""
    return min(1e-5, float(num_documents) ** -1.1)


PRIVACY_UNIT = "per document (add/remove one document)"
NOT_COVERED = "not_covered_by_dp"


# --- argument parsing -----------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):
        if "(default" in (action.help or ""):  # the flag explains its default itself
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


def _model_args(p, seq_len_default):
    from .models import CONFIGS

    p.add_argument("--model", default="tiny", choices=list(CONFIGS), metavar="NAME",
                   help="reference Llama shape from longshield_fx.models.CONFIGS: " + ", ".join(CONFIGS) +
                   ". The default is 'tiny' (131k parameters), not 'small' (3.1M): on a 2-core CPU "
                   "'small' at T=2048 takes ~12 s per step, so 50 steps would not fit in 10 minutes; "
                   "'tiny' does 50 steps at T=2048 in a few minutes")
    p.add_argument("--hf-config", metavar="PATH", default=None,
                   help="train a Hugging Face LlamaForCausalLM built (randomly initialised, sdpa attention) "
                   "from this local config JSON instead of --model; needs transformers and vocab_size >= 256")
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.replace("``", ""), formatter_class=_Formatter,
                     epilog="Errors print one line; set LONGSHIELD_FX_DEBUG=1 for the traceback.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,inspect,plan}")
    # Listed for --help; `plan` has its own parser (longshield_fx.plan), dispatched in main().
    sub.add_parser("plan", add_help=False,
                   help="predict the longest context that fits on N GPUs (see `longshield-fx plan --help`)")

    t = sub.add_parser(
        "train", formatter_class=_Formatter, prog=f"{PROG} train",
        help="DP-SGD training on this machine's Python standard library sources",
        description=(
            "DP-SGD training of a byte-level causal LM on this machine's Python standard library sources\n"
            "(the embedded 'private codebase'): Poisson-sampled logical batches cut into fixed-shape masked\n"
            "physical batches, per-sample clipping and Gaussian noise inside the compiled graph, AdamW.\n"
            "The privacy unit is the DOCUMENT: one stdlib file is one row (its first T bytes; the rest of a\n"
            "longer file is not used, and the truncation is reported), sampled and clipped as one sample, so ε\n"
            "is per document (add/remove one document). σ is calibrated before training so that ε after\n"
            "--steps steps is <= --target-epsilon at δ = min(1e-5, N^-1.1) (N = number of documents), unless\n"
            "--sigma is given. The DP noise and the sampling come from secret ChaCha20 streams keyed by the OS;\n"
            "--seed seeds the model initialisation only.\n\n"
            "Writes to --out: metrics.jsonl (one JSON line per step), loss_vs_epsilon.png, summary.json,\n"
            "final_model.pt (the trained model's state dict: covered by ε) and checkpoints/ckpt-<step>.pt.\n"
            "Training losses, timings and counts (non-finite samples; batch sizes and tokens only with\n"
            "--log-private-stats) come from the private data without noise: they are NOT covered by ε and\n"
            "are written only under the key 'not_covered_by_dp'. Checkpoints are SECRET: they hold the\n"
            "noise key and the sampling key (anyone holding them can subtract the noise); keep them like the\n"
            "data.\n\n"
            "Context parallel: torchrun --standalone --nproc-per-node 2 -m longshield_fx train --cp 2\n"
            "(world size W = dp * cp; each of the W/cp data-parallel groups takes a share of every\n"
            "logical batch; all ranks read the same corpus and build the same model from --seed, rank 0's noise\n"
            "and sampling keys are broadcast to all; rank 0 prints and writes)."))
    _model_args(t, seq_len_default=2048)
    t.set_defaults(physical_batch_size=4)
    t.add_argument("--steps", type=positive_int, default=50, help="optimizer steps (Poisson logical batches)")
    t.add_argument("--expected-batch-size", type=positive_float, default=8.0, metavar="E",
                   help="expected logical batch size; the sampling rate is q = E/N")
    g = t.add_mutually_exclusive_group()
    g.add_argument("--target-epsilon", type=positive_float, default=8.0, metavar="EPS",
                   help="ε budget for the whole run: σ is calibrated to it before training")
    g.add_argument("--sigma", type=nonneg_float, default=None,
                   help="noise multiplier σ, instead of calibrating one from --target-epsilon")
    t.add_argument("--delta", type=positive_float, default=None,
                   help="δ of the (ε, δ) guarantee, per document (default: min(1e-5, N^-1.1), N = number of "
                   "documents: well below 1/N, as Ponomareva et al. 2023 'How to DP-fy ML' recommend, so that "
                   "a mechanism leaking one whole document with probability δ leaks far less than one "
                   "document in expectation)")
    t.add_argument("--accountant", choices=["pld", "rdp"], default="pld",
                   help="privacy accountant (dp-accounting): pld is the tightest, rdp is looser")
    t.add_argument("--insecure-seed", type=int, default=None, metavar="N",
                   help="TESTS ONLY, VOIDS THE PRIVACY GUARANTEE: derive the noise key and the sampling key from "
                   "this public seed (separate keys), so runs are reproducible by anyone; a warning is printed "
                   "and the seed is recorded in summary.json and signature.json")
    t.add_argument("--log-private-stats", action="store_true",
                   help="also write the logical batch size and token counts of every step (under "
                   "'not_covered_by_dp' in metrics.jsonl and summary.json): they are computed from the private "
                   "data without noise and are NOT covered by ε")
    t.add_argument("--lr", type=positive_float, default=2e-3, help="AdamW learning rate")
    t.add_argument("--weight-decay", type=nonneg_float, default=0.01, help="AdamW weight decay")
    t.add_argument("--max-files", type=nonneg_int, default=400,
                   help="stdlib .py files read (sorted by path) for the corpus; 0 reads all")
    t.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model and the compiled step run (cuda: NCCL under torchrun; written for the "
                   "CUDA attention kernels but not yet run on a GPU)")
    t.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default: runs/train, or the --resume directory). Its checkpoints/ are "
                   "SECRET: they hold the noise key and the sampling key")
    t.add_argument("--save-every", type=nonneg_int, default=25, metavar="K",
                   help="write a checkpoint every K steps and at the end (0: never)")
    t.add_argument("--keep-checkpoints", type=positive_int, default=2, metavar="N",
                   help="keep the N newest checkpoints, delete older ones")
    t.add_argument("--resume", default=None, metavar="DIR",
                   help="continue exactly from the newest complete checkpoint of the run in DIR (its --out, "
                   "or its checkpoints/ folder); refused if the model, DP config, T or batch sizes differ. The "
                   "checkpoint is SECRET (noise and sampling keys): the resumed run continues the same streams")
    t.set_defaults(func=train)

    i = sub.add_parser(
        "inspect", formatter_class=_Formatter, prog=f"{PROG} inspect",
        help="show what the passes did to the training graph; draw one block as SVG",
        description=(
            "Build the training graph for one (random) batch without training and print: the passes with\n"
            "node counts before/after each, the per-sample rule of every parameter, and the collectives the\n"
            "passes inserted with their bytes per physical batch. Writes the rewritten graph of one\n"
            "transformer block as SVG, and the whole graph's code, to --out.\n\n"
            "--cp N > 1 outside torchrun uses a fake process group of N ranks in this one process\n"
            "(shapes and collectives are real, nothing is sent)."))
    _model_args(i, seq_len_default=256)
    i.set_defaults(physical_batch_size=2)
    i.add_argument("--block", default="layers.0", metavar="PATH",
                   help="module path of the block to draw (matched as a dotted component sequence)")
    i.add_argument("--svg-backend", choices=["auto", "graphviz", "builtin"], default="auto",
                   help="graphviz: laid out by graphviz's dot program (apt-get install graphviz); builtin: a "
                   "dependency-free layered layout; auto: graphviz when dot is on PATH, else builtin")
    i.add_argument("--out", default="runs/inspect", metavar="DIR", help="where the SVG and graph code go")
    i.add_argument("--memory", action="store_true",
                   help="print the liveness memory estimate of the training graph (peak and the tensors making it)")
    i.add_argument("--timeline", choices=["H100-NVLink", "H100-IB", "CPU-gloo"], nargs="?", const="H100-NVLink",
                   default=None, help="draw the cost-model compute/communication timeline for this hardware to "
                   "timeline.png in --out and print the exposed communication")
    i.set_defaults(func=inspect)
    return parser


# --- shared set-up ----------------------------------------------------------------------------

def _say(*args, **kwargs):
    if _RANK == 0:
        print(*args, **kwargs, flush=True)


_RANK = 0


def _check_seq_len(args):
    if args.seq_len < 2:
        raise CLIError(f"--seq-len must be >= 2 (a next-token loss needs two tokens), got {args.seq_len}")
    if args.seq_len % (2 * args.cp):
        raise CLIError(f"--seq-len {args.seq_len} is not a multiple of 2*cp = {2 * args.cp} (each of the {args.cp} "
                       "context-parallel ranks holds two zig-zag chunks)")


def _load_hf_config(path):
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"--hf-config: no such file: {path}")
    try:
        import transformers
    except ImportError:
        raise CLIError("--hf-config needs the transformers package: pip install transformers") from None
    try:
        cfg = transformers.LlamaConfig.from_json_file(str(p))
    except (OSError, ValueError) as e:
        raise CLIError(f"--hf-config: cannot read a LlamaConfig from {path}: {' '.join(str(e).split())}") from None
    if cfg.vocab_size < 256:
        raise CLIError(f"--hf-config: vocab_size is {cfg.vocab_size}, but the corpus is byte-level (256 tokens)")
    return cfg


_HF_VOLATILE = {"transformers_version", "_name_or_path", "architectures", "id2label", "label2id",
                "_attn_implementation_autoset", "dtype", "torch_dtype"}


def build_model(args):
    """(CausalLMLoss model, model description for the signature, display name)."""
    import longshield_fx as lf

    if args.hf_config:
        cfg = _load_hf_config(args.hf_config)
        import transformers

        torch.manual_seed(args.seed)
        lm = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
        desc = {"kind": "hf_llama", **{k: v for k, v in json.loads(cfg.to_json_string(use_diff=False)).items()
                                       if k not in _HF_VOLATILE}}
        return lf.CausalLMLoss(lm), desc, f"HF LlamaForCausalLM ({args.hf_config})"
    from .models import CONFIGS, Llama

    torch.manual_seed(args.seed)
    lm = Llama.from_name(args.model)
    return lf.CausalLMLoss(lm), {"kind": "llama", "name": args.model, **dataclasses.asdict(CONFIGS[args.model])}, \
        f"Llama {args.model!r}"


def _under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup_distributed(cp: int, device: str, command: str):
    """(mesh or None, dp, dp_rank). Inits the default process group under torchrun."""
    global _RANK
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

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
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10))
    _RANK = dist.get_rank()
    dp = world // cp
    if dp > 1:
        mesh = init_device_mesh(device, (dp, cp), mesh_dim_names=("dp", "cp"))
        return mesh, dp, mesh["dp"].get_local_rank()
    return init_device_mesh(device, (cp,), mesh_dim_names=("cp",)), 1, 0


# --- checkpoints ----------------------------------------------------------------------------

def _fsync_dir(path: Path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(obj, path: Path):
    """torch.save to a temp file in the same folder, fsync, then os.replace: a reader sees the
    old file or the complete new one, never a partial one (the temp name never matches ckpt-*.pt)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``folder``, newest first (temp files never match)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _CKPT_RE.match(p.name)) and p.is_file()]
    return sorted(found, reverse=True)


def resolve_resume(resume: str) -> tuple[Path, Path]:
    """(run dir, checkpoints dir) from --resume DIR (the run's --out or its checkpoints/ folder)."""
    d = Path(resume)
    if not d.is_dir():
        raise CLIError(f"--resume: no such directory: {resume}")
    if list_checkpoints(d) and d.name == "checkpoints":
        return d.parent, d
    if checkpoint_dir(d).is_dir():
        return d, checkpoint_dir(d)
    if list_checkpoints(d):
        return d, d
    raise CLIError(f"--resume: no checkpoint (ckpt-<step>.pt) in {resume} or {checkpoint_dir(d)}")


def load_latest(folder: Path) -> tuple[dict, Path]:
    skipped = []
    for _, path in list_checkpoints(folder):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a damaged file: fall back to an older one
            skipped.append(f"{path.name} ({type(e).__name__})")
            continue
        if isinstance(state, dict) and state.get("format") == CHECKPOINT_FORMAT and state.get("complete"):
            if skipped:
                _say(f"warning: skipped unreadable checkpoint(s) {', '.join(skipped)}", file=sys.stderr)
            return state, path
        skipped.append(f"{path.name} (not a longshield-fx checkpoint)")
    raise CLIError(f"--resume: no complete checkpoint in {folder}" + (f"; unreadable: {', '.join(skipped)}" if skipped else ""))


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def signature_diff(saved: dict, now: dict) -> list[str]:
    """'key: X in the checkpoint, Y now' for every differing (flattened) key, in signature order."""
    a, b = _flatten(saved), _flatten(now)
    missing = object()

    def fmt(v, other):
        if v is missing:
            return "unset"
        if isinstance(v, float) and isinstance(other, float) and f"{v:.6g}" != f"{other:.6g}":
            return f"{v:.6g}"
        return repr(v)

    diffs = []
    for key in list(b) + [k for k in a if k not in b]:
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            diffs.append(f"{key}: {fmt(va, vb)} in the checkpoint, {fmt(vb, va)} now")
    return diffs


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


# --- train ----------------------------------------------------------------------------------

def _read_metrics(path: Path, upto: int | None = None) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if upto is None or row.get("step", 0) <= upto:
                rows.append(row)
    return rows


def _fmt_time(s: float) -> str:
    return f"{int(s // 60)}m{s % 60:04.1f}s" if s >= 60 else f"{s:.1f}s"


def train(args) -> int:
    t_start = time.time()
    import torch.distributed as dist

    import longshield_fx as lf

    from .data import PoissonBatches

    if args.steps < 1:
        raise CLIError(f"--steps must be >= 1, got {args.steps}")
    _check_seq_len(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA device is available")
    if args.hf_config:
        _load_hf_config(args.hf_config)  # fail fast, before the corpus and processes
    run_dir = Path(args.out) if args.out else None
    ckpt_folder = None
    if args.resume:
        resumed_run, ckpt_folder = resolve_resume(args.resume)
        run_dir = run_dir or resumed_run
    run_dir = run_dir or Path("runs/train")

    mesh, dp, dp_rank = setup_distributed(args.cp, args.device, "train")
    rank0 = _RANK == 0

    corpus = stdlib_corpus(args.seq_len, args.max_files or None)
    N, T = corpus.num_documents, args.seq_len
    if args.expected_batch_size > N:
        raise CLIError(f"--expected-batch-size {args.expected_batch_size:g} exceeds the corpus size N = {N} "
                       "documents; lower it or raise --max-files")
    q = args.expected_batch_size / N
    delta = args.delta if args.delta is not None else default_delta(N)
    insecure = args.insecure_seed
    accountant_name = args.accountant.upper()

    model, model_desc, model_name = build_model(args)  # the only use of --seed (and dropout's RNG)
    device = torch.device(args.device)
    model.to(device)

    def make_signature(sigma):
        return _jsonable({
            "model": model_desc, "init_seed": args.seed,
            "dp": {"max_grad_norm": args.max_grad_norm, "noise_multiplier": sigma, "clipping": args.clipping,
                   "sample_rate": q, "delta": delta, "accountant": args.accountant, "insecure_seed": insecure,
                   "target_epsilon": None if args.sigma is not None else args.target_epsilon},
            "seq_len": T, "physical_batch_size": args.physical_batch_size,
            "expected_batch_size": args.expected_batch_size, "steps": args.steps,
            "corpus": {"unit": "document", "num_documents": N, "max_files": args.max_files},
            "optimizer": {"name": "AdamW", "lr": args.lr, "weight_decay": args.weight_decay},
        })

    state = None
    if ckpt_folder is not None:  # refuse a different run before calibrating and compiling
        state, path = load_latest(ckpt_folder)
        saved = state["signature"]
        sigma = args.sigma if args.sigma is not None else saved.get("dp", {}).get("noise_multiplier")
        diffs = signature_diff(saved, make_signature(sigma))
        if diffs:
            raise CLIError(f"refusing to resume from {path}: it was written by a different run ("
                           + "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "") + ")")
        # Same calibration inputs (target ε, δ, q, steps, accountant): the checkpoint's σ is the calibrated one.
    elif args.sigma is not None:
        sigma = args.sigma
    else:
        sigma = lf.calibrate_noise(args.target_epsilon, delta, q, args.steps, method=args.accountant)
    signature = make_signature(sigma)
    # No seed: the noise key is 256 bits from the OS (rank 0's, broadcast), unless --insecure-seed.
    config = lf.DPConfig(args.max_grad_norm, sigma, clipping=args.clipping, accountant=args.accountant,
                         insecure_seed=insecure)
    engine = lf.compile(model, mesh, config=config, checkpoint=None if args.checkpoint == "none" else args.checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    # Built at the same point on every rank (its key is broadcast from rank 0); one row = one document.
    batches = PoissonBatches(corpus.dataset(), sample_rate=q, physical_batch_size=args.physical_batch_size,
                             insecure_seed=insecure, steps=args.steps)
    expected = batches.expected_batch_size

    n_params = sum(p.numel() for p in model.parameters())
    metrics_path = run_dir / "metrics.jsonl"
    start_step, tokens_seen, elapsed_before = 0, 0, 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        batches.load_state_dict(state["sampler"])  # continues the same secret sampling stream
        engine.load_state_dict(state["engine"])  # accountant and the same secret noise stream
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"])
        start_step, tokens_seen, elapsed_before = state["step"], state["tokens"], state["elapsed_s"]
        state = None
    # Metrics of the steps before the checkpoint (lines written after it by a killed run are dropped).
    rows = _read_metrics((resumed_run if args.resume else run_dir) / "metrics.jsonl", upto=start_step) \
        if start_step else []

    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint_dir(run_dir).mkdir(exist_ok=True)
        tmp = metrics_path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, metrics_path)
        (run_dir / "signature.json").write_text(json.dumps(signature, indent=1) + "\n")
    world = f"cp={args.cp}, dp={dp}" if mesh is not None else "one process"
    _say(f"model: {model_name}, {n_params:,} parameters, T={T}, {world}, device {device.type}, "
         f"checkpointing {args.checkpoint}")
    _say(f"corpus: {N} documents (one stdlib file per row, its first {T} bytes; the privacy unit is the document); "
         f"{corpus.truncated} truncated to {T} bytes, {corpus.fraction_used:.1%} of the corpus bytes used"
         + (f", {corpus.skipped} file{'s' * (corpus.skipped != 1)} under 2 bytes left out" if corpus.skipped else "")
         + " (these counts are NOT covered by DP)")
    _say(f"sampling: Poisson q = {q:.4g} (E[B] = {expected:g} documents), physical batch {args.physical_batch_size}")
    how = "given" if args.sigma is not None else f"calibrated for ε = {args.target_epsilon:g} over {args.steps} steps"
    if args.delta is None:
        why = f"min(1e-5, N^-1.1) for N = {N} documents, well below 1/N = {1 / N:.3g}"
    else:
        why = "given" + ("" if delta < 1 / N else f"; NOT below 1/N = {1 / N:.3g}: a mechanism that releases one "
                         "whole document with probability δ would satisfy this guarantee")
    _say(f"privacy: σ = {sigma:.4g} ({how}), δ = {delta:.3g} ({why}), C = {args.max_grad_norm:g}, "
         f"{args.clipping} clipping, {accountant_name} accountant, ε {PRIVACY_UNIT}")
    if insecure is not None:
        _say(f"WARNING: --insecure-seed {insecure}: the DP noise and the Poisson sampling are derived from a public "
             "seed; anyone who knows it can regenerate the noise and subtract it. NO privacy guarantee holds for "
             "this run (tests only).")
    if start_step:
        _say(f"resumed from {path} at step {start_step}/{args.steps}, ε so far {engine.epsilon(delta):.3f}"
             + (" (the run had already finished)" if start_step >= args.steps else ""))

    from tqdm import tqdm

    def save(step):
        if not rank0:
            return
        state = {  # SECRET: the sampler's and the engine's states hold the sampling and noise keys
            "format": CHECKPOINT_FORMAT, "complete": True, "step": step, "signature": signature,
            "model": model.state_dict(), "optimizer": opt.state_dict(), "sampler": batches.state_dict(),
            "engine": engine.state_dict(), "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if device.type == "cuda" else None,
            "tokens": tokens_seen, "elapsed_s": elapsed_before + (time.time() - t_loop),
        }
        folder = checkpoint_dir(run_dir)
        atomic_save(state, folder / f"ckpt-{step:08d}.pt")
        for _, old in list_checkpoints(folder)[args.keep_checkpoints:]:
            old.unlink(missing_ok=True)

    dp_group = mesh["dp"].get_group() if dp > 1 else None
    reduce_device = device if dp_group is not None and dist.get_backend(dp_group) == "nccl" else torch.device("cpu")
    t_loop = time.time()
    startup = t_loop - t_start
    bar = tqdm(total=args.steps, initial=start_step, desc="train", disable=not rank0, unit="step",
               dynamic_ncols=True, file=sys.stderr)
    last_loss = None
    with open(metrics_path, "a") if rank0 else open(os.devnull, "w") as metrics:
        for logical in (batches if start_step < args.steps else []):
            step = batches.step
            physical = logical.physical
            if dp > 1:  # each dp group takes every dp-th physical batch; an idle group runs a masked one
                mine = physical[dp_rank::dp] or [(physical[0][0], torch.zeros_like(physical[0][1]))]
            else:
                mine = physical
            nonfinite_before = engine.nonfinite_samples
            # loss sum, predicted tokens, real tokens of this rank's real rows (NOT covered by DP)
            stats = torch.zeros(4, dtype=torch.float64)
            for (ids, labels), mask in mine:
                real = mask.bool()
                loss_sum = engine.accumulate(ids.to(device), labels.to(device), mask=mask.to(device))
                stats[0] += loss_sum.detach().double().cpu()
                stats[1] += int((labels[real, 1:] != -100).sum())
                stats[2] += int((labels[real] != -100).sum())
            # cp ranks of a dp group count the same samples (norms are all-reduced over cp): sum over dp only
            stats[3] = engine.nonfinite_samples - nonfinite_before
            engine.finalize(logical)  # every dp rank, with the same logical batch: q and E[B] from the sampler
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dp_group is not None:
                stats = stats.to(reduce_device)
                dist.all_reduce(stats, group=dp_group)
                stats = stats.cpu()
            eps = engine.epsilon(delta)
            tokens_seen += int(stats[2])
            elapsed = elapsed_before + time.time() - t_loop
            loss = float(stats[0]) / float(stats[1]) if stats[1] > 0 else None
            last_loss = loss if loss is not None else last_loss
            # elapsed_s too: each physical batch takes time, so per-step timings trace the batch sizes
            private = {"train_loss": loss, "nonfinite_samples": int(stats[3]), "elapsed_s": round(elapsed, 3)}
            if args.log_private_stats:
                private.update(logical_batch_size=logical.size, tokens=tokens_seen,
                               tokens_per_s=round(tokens_seen / max(elapsed, 1e-9), 1))
            row = {"step": step, "epsilon": eps, "delta": delta, "sigma": sigma, NOT_COVERED: private}
            rows.append(row)
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            if args.save_every and (step % args.save_every == 0 or step == args.steps):
                save(step)
            bar.set_postfix_str(f"ε={eps:.2f} loss(not DP)={'-' if last_loss is None else f'{last_loss:.3f}'}",
                                refresh=False)
            bar.update()
    bar.close()

    def private_of(row):
        return row.get(NOT_COVERED) or {}

    eps = engine.epsilon(delta)
    if rank0:
        final = run_dir / "final_model.pt"
        atomic_save(model.state_dict(), final)
        from .plots import loss_vs_epsilon

        png = loss_vs_epsilon([{"epsilon": r["epsilon"], "loss": private_of(r).get("train_loss")} for r in rows],
                              run_dir / "loss_vs_epsilon.png", title=plot_title(model_name, T, expected, sigma))
    losses = [private_of(r)["train_loss"] for r in rows if private_of(r).get("train_loss") is not None]
    nonfinite = sum(private_of(r).get("nonfinite_samples", 0) for r in rows)
    k = min(5, max(1, len(losses) // 2))
    first = sum(losses[:k]) / k if losses else float("nan")
    last = sum(losses[-k:]) / k if losses else float("nan")
    wall = time.time() - t_start
    loop = time.time() - t_loop
    done = max(1, args.steps - start_step)
    c = corpus.stats()
    private = {
        "train_loss_first": losses[0] if losses else None, "train_loss_last": losses[-1] if losses else None,
        f"train_loss_first{k}_mean": first, f"train_loss_last{k}_mean": last, "nonfinite_samples": nonfinite,
        "wall_s": round(wall, 2), "s_per_step": round(loop / done, 4),  # timings trace the batch sizes
        "corpus": {key: c[key] for key in ("truncated_documents", "bytes_used", "bytes_total", "bytes_used_fraction",
                                           "skipped_files_under_2_bytes")},
    }
    if args.log_private_stats:
        private["tokens"] = tokens_seen
        private["tokens_per_s"] = rows[-1][NOT_COVERED].get("tokens_per_s") if rows else None
    summary = {
        "steps": args.steps, "resumed_from": start_step or None,
        "privacy_unit": "document (add/remove one document)", "epsilon": eps, "delta": delta,
        "delta_rule": "min(1e-5, N^-1.1)" if args.delta is None else "given", "accountant": args.accountant,
        "target_epsilon": None if args.sigma is not None else args.target_epsilon, "sigma": sigma,
        "sample_rate": q, "expected_batch_size": expected, "max_grad_norm": args.max_grad_norm,
        "insecure_seed": insecure, "privacy_void": insecure is not None, "init_seed": args.seed,
        "corpus": {"documents": N, "seq_len": T, "max_files": args.max_files},
        "startup_s": round(startup, 2), "parameters": n_params,
        NOT_COVERED: private,
    }
    if rank0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    budget = f" <= target {args.target_epsilon:g}" if args.sigma is None and eps <= args.target_epsilon else (
        f" > target {args.target_epsilon:g}!" if args.sigma is None else "")
    speed = f"{loop / done:.2f} s/step (timings trace the batch sizes: NOT covered by DP)"
    if args.log_private_stats and private.get("tokens_per_s") is not None:
        speed += f", {private['tokens_per_s']:.0f} tokens/s (NOT covered by DP)"
    _say(f"done: {args.steps} steps in {_fmt_time(wall)} (startup {_fmt_time(startup)}, training {_fmt_time(loop)}), "
         f"{speed}")
    _say(f"training loss/token (NOT covered by DP): {first:.3f} -> {last:.3f} (mean of the first/last {k} non-empty "
         f"steps); non-finite per-sample gradients (NOT covered by DP): {nonfinite}")
    _say(f"privacy: ε = {eps:.3f} {PRIVACY_UNIT}, δ = {delta:.3g}, {accountant_name} accountant{budget} "
         f"(σ = {sigma:.4g}, q = {q:.4g}, {args.steps} steps)"
         + (f"; VOID: --insecure-seed {insecure} made the noise and the sampling public" if insecure is not None
            else ""))
    if rank0:
        _say(f"wrote {metrics_path}, {png}, {final}" +
             (f", checkpoints in {checkpoint_dir(run_dir)} (SECRET: noise and sampling keys)" if args.save_every
              else ""))
    return 0


def plot_title(model_name: str, T: int, expected: float, sigma: float) -> str:
    return (f"{model_name}, T={T}, E[B]={expected:g}, σ={sigma:.3g}\nε {PRIVACY_UNIT}\n"
            "training loss: NOT covered by DP (no noise)")



# --- inspect --------------------------------------------------------------------------------

def _is_collective(node) -> bool:
    t = str(node.target)
    return node.op == "call_function" and (
        (t.startswith("_c10d_functional.") and "wait_tensor" not in t) or t.startswith("longshield.ring_attention"))


def collective_bytes(engine, node) -> int:
    """Bytes one collective node moves, by ``Engine.communication_bytes``'s own convention: the
    engine's counter is run on a one-node graph holding just this node (and its inputs' metadata)."""
    import types

    from torch import fx

    g = fx.Graph()
    env = {}
    for a in node.all_input_nodes:
        env[a] = g.placeholder(a.name)
        env[a].meta = dict(a.meta)
    g.node_copy(node, lambda a: env[a])
    return sum(engine.parallel.communication_bytes(types.SimpleNamespace(graph=g)).values())


def _block_pattern(block: str):
    return re.compile(r"(^|[.\]'\[])" + re.escape(block).replace(r"\.", r"(\.|\[)") + r"($|[.\]])")


def block_nodes(gm, block: str) -> list:
    """Nodes of the block at module path ``block``: forward nodes by ``nn_module_stack``, backward
    ones by ``fwd_nn_module_stack``, plus nodes a pass inserted (no module metadata) whose inputs
    all come from the block (or are graph inputs), e.g. the block's per-sample einsums and norms."""
    pat = _block_pattern(block)
    chosen: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack")
        if stack:
            if any(pat.search(str(v[0])) for v in stack.values()):
                chosen[n] = None
        else:
            ins = n.all_input_nodes
            if any(a in chosen for a in ins) and all(a in chosen or a.op == "placeholder" for a in ins):
                chosen[n] = None
    return list(chosen)


def block_graph_module(gm, nodes):
    """A stand-alone GraphModule of ``nodes``: outside inputs become placeholders, values used
    outside become outputs."""
    from torch import fx

    chosen = set(nodes)
    g = fx.Graph()
    env = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in chosen and a not in env:
                env[a] = g.placeholder(a.name)
                env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    outs = [env[n] for n in nodes if any(u not in chosen for u in n.users)]
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def _collapse(names: list[str]) -> list[str]:
    """Parameter names with layer indices replaced by '*', deduplicated, in first-seen order."""
    seen = {}
    for n in names:
        seen.setdefault(re.sub(r"\.\d+\.", ".*.", n), None)
    return list(seen)


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def inspect_report(engine, captured, gm, ctx, *, header: str, cp: int, dp: int) -> str:
    from .passes import format_log  # noqa: F401 (same formatting conventions as print(engine))

    lines = [header, "passes (graph nodes before -> after):"]
    width = max(len(name) for name, *_ in ctx.log)
    for name, before, after, added, removed in ctx.log:
        lines.append(f"  {name:<{width}}  {before:>5} -> {after:>5}")
        top = sorted(added.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
        if top:
            lines.append("      + " + ", ".join(f"{k} x{v}" for k, v in top))
        top = sorted(removed.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
        if top:
            lines.append("      - " + ", ".join(f"{k} x{v}" for k, v in top))
    lines.append("per-sample rules:")
    by_rule: dict[str, list[str]] = {}
    for name, rule in ctx.rules_used.items():
        by_rule.setdefault(str(rule), []).append(name)
    for rule, names in sorted(by_rule.items()):
        lines.append(f"  {rule} x{len(names)}: {', '.join(_collapse(names))}")
    lines.append("per parameter (rule, shape, cp-shard dim of its clipped sum):")
    shapes = {n: tuple(p.shape) for n, p in engine.model.named_parameters()}
    nw = max(len(n) for n in ctx.rules_used) if ctx.rules_used else 0
    for name in captured.param_names:
        shard = ctx.shard_dims.get(name)
        shard_txt = "-" if cp == 1 else ("replicated" if shard is None else f"dim {shard}")
        lines.append(f"  {name:<{nw}}  {ctx.rules_used.get(name, '?'):<10} {list(shapes.get(name, ()))!s:<14} {shard_txt}")
    lines.append("collectives in the graph (bytes per physical batch):")
    totals = engine.communication_bytes()
    colls = [n for n in gm.graph.nodes if _is_collective(n)]
    if not colls:
        lines.append("  none (cp=1: the graph runs in one process)")
    else:
        lines.append("  totals: " + ", ".join(f"{k} {v:,} B ({_fmt_bytes(v)})" for k, v in totals.items()))
        for n in colls:
            v = next((a.meta.get("val") for a in n.args if isinstance(a, torch.fx.Node)), None)
            shape = (f"{str(v.dtype).replace('torch.', '')}[{','.join(map(str, v.shape))}]"
                     if isinstance(v, torch.Tensor) else "?")
            op = str(n.target).split(".")[1]
            lines.append(f"  {n.name:<42} {op:<28} {shape:<22} {collective_bytes(engine, n):>10,} B")
    if cp > 1 or dp > 1:
        gathered = sum(p.numel() * 4 for n, p in engine.model.named_parameters()
                       if ctx.shard_dims.get(n) is not None)
        outside = [f"all_gather of the cp-sharded clipped sums ({_fmt_bytes(gathered)} fp32 gathered)"] if cp > 1 else []
        if dp > 1:
            outside.append(f"all_reduce over dp of the full clipped sums ({_fmt_bytes(sum(p.numel() * 4 for p in engine.model.parameters()))})")
        lines.append("outside the graph, once per logical batch (finalize): " + "; ".join(outside))
    return "\n".join(lines)


def inspect(args) -> int:
    import longshield_fx as lf

    _check_seq_len(args)
    if args.hf_config:
        _load_hf_config(args.hf_config)
    fake = False
    if args.cp > 1 and not _under_torchrun():
        from .runtime.parallel import fake_cp_mesh

        mesh, dp, fake = fake_cp_mesh(args.cp), 1, True  # destroyed in main()
    else:
        mesh, dp, _ = setup_distributed(args.cp, "cpu", "inspect")
    model, _, model_name = build_model(args)
    config = lf.DPConfig(args.max_grad_norm, 1.0, clipping=args.clipping)  # graph only: no noise drawn
    engine = lf.compile(model, mesh, config=config, checkpoint=None if args.checkpoint == "none" else args.checkpoint)
    ids = torch.randint(0, 256, (args.physical_batch_size, args.seq_len),
                        generator=torch.Generator().manual_seed(args.seed))
    captured, gm, ctx = engine._training_graph((ids, ids))
    n_params = sum(p.numel() for p in model.parameters())
    where = f"cp={args.cp}" + (" (fake process group, one process)" if fake else "") + (f", dp={dp}" if dp > 1 else "")
    header = (f"{model_name}: {n_params:,} parameters; batch ({args.physical_batch_size}, {args.seq_len}); {where}; "
              f"checkpointing {args.checkpoint}; {args.clipping} clipping")
    _say(inspect_report(engine, captured, gm, ctx, header=header, cp=args.cp, dp=dp))
    if args.memory:
        from .memory import estimate_memory

        _say(estimate_memory(gm).format())

    if _RANK == 0:
        from .plots import graph_svg

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "training_graph.py").write_text(gm.code)
        nodes = block_nodes(gm, args.block)
        if not nodes:
            raise CLIError(f"--block {args.block!r}: no graph node comes from a module at that path")
        kinds = {"forward": 0, "backward": 0, "inserted": 0}
        for n in nodes:
            kinds["forward" if n.meta.get("nn_module_stack") else
                  "backward" if n.meta.get("fwd_nn_module_stack") else "inserted"] += 1
        svg = out / f"block_{args.block.replace('/', '_')}.svg"
        backend = graph_svg(block_graph_module(gm, nodes), svg, title=f"{model_name}: {args.block} (rewritten)",
                            backend=args.svg_backend)
        if args.timeline:
            from .cost_model import HARDWARE, draw_timeline, simulate

            timeline = simulate(gm, HARDWARE[args.timeline])
            draw_timeline(timeline, str(out / "timeline.png"), f"{model_name}, cp={args.cp}, {args.timeline}: "
                          f"exposed communication {timeline.exposed_comm * 1e3:.3f} of {timeline.comm * 1e3:.3f} ms")
            _say(f"timeline ({args.timeline}, cost model): step {timeline.total * 1e3:.3f} ms, communication "
                 f"{timeline.comm * 1e3:.3f} ms of which exposed {timeline.exposed_comm * 1e3:.3f} ms -> "
                 f"{out / 'timeline.png'}")
        _say(f"block {args.block}: {len(nodes)} nodes ({kinds['forward']} forward, {kinds['backward']} backward, "
             f"{kinds['inserted']} inserted by passes) -> {svg} ({backend}, {svg.stat().st_size:,} bytes); "
             f"whole graph code -> {out / 'training_graph.py'}")
    return 0


# --- entry point ----------------------------------------------------------------------------

def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        from .plan import main as plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    prefix = f"{PROG} {args.command}"
    try:
        return args.func(args)
    except CLIError as e:
        print(f"{prefix}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError, ImportError, TypeError) as e:
        if os.environ.get("LONGSHIELD_FX_DEBUG"):
            raise
        rank = f" [rank {_RANK}]" if _under_torchrun() else ""
        print(f"{prefix}{rank}: error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
