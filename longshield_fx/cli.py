"""``longshield-fx``: command-line entry points.

``longshield-fx train`` trains the reference Llama with DP-SGD on an embedded long-document
corpus: this machine's Python standard library sources, read as bytes and treated as a
private codebase. Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch


def stdlib_corpus(seq_len: int, max_files: int | None = None) -> torch.Tensor:
    """(N, seq_len) byte tokens from the standard library's .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    if max_files:
        files = files[:max_files]
    data = bytearray()
    for f in files:
        data += f.read_bytes() + b"\n"
    n = len(data) // seq_len
    return torch.frombuffer(bytes(data[: n * seq_len]), dtype=torch.uint8).view(n, seq_len).long()


def _positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longshield-fx", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="DP-SGD training of the reference Llama on stdlib sources",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("--model", default="tiny", help="reference Llama config name (longshield_fx.models.CONFIGS)")
    t.add_argument("--seq-len", type=_positive(int), default=256, help="tokens per sequence (T)")
    t.add_argument("--steps", type=_positive(int), default=50, help="optimizer steps (logical batches)")
    t.add_argument("--physical-batch-size", type=_positive(int), default=4, help="rows per compiled step")
    t.add_argument("--expected-batch-size", type=_positive(float), default=8.0,
                   help="expected logical batch size; sample rate q = this / N")
    t.add_argument("--target-epsilon", type=_positive(float), default=8.0,
                   help="ε to calibrate σ for over all steps (ignored with --sigma)")
    t.add_argument("--sigma", type=float, default=None, help="noise multiplier; overrides --target-epsilon")
    t.add_argument("--max-grad-norm", type=_positive(float), default=1.0, help="clipping threshold C")
    t.add_argument("--clipping", choices=["flat", "per_layer", "automatic"], default="flat", help="clipping mode")
    t.add_argument("--lr", type=_positive(float), default=2e-3, help="AdamW learning rate")
    t.add_argument("--max-files", type=int, default=400, help="stdlib files read for the corpus (0: all)")
    t.add_argument("--seed", type=int, default=0, help="seed of model init, sampling and noise")
    t.add_argument("--out", default="runs/train", help="output directory for metrics.jsonl")
    return parser


def train(args) -> int:
    import longshield_fx as lf
    from longshield_fx.data import PoissonBatches
    from longshield_fx.models import CONFIGS, Llama

    if args.model not in CONFIGS:
        raise SystemExit(f"longshield-fx: unknown --model {args.model!r}; choose from {', '.join(CONFIGS)}")
    if args.sigma is not None and args.sigma < 0:
        raise SystemExit("longshield-fx: --sigma must be >= 0")
    torch.manual_seed(args.seed)
    tokens = stdlib_corpus(args.seq_len, args.max_files or None)
    N = len(tokens)
    q = min(1.0, args.expected_batch_size / N)
    delta = 1.0 / N
    sigma = args.sigma if args.sigma is not None else lf.calibrate_noise(args.target_epsilon, delta, q, args.steps)
    model = lf.CausalLMLoss(Llama.from_name(args.model))
    engine = lf.compile(model, config=lf.DPConfig(args.max_grad_norm, sigma, clipping=args.clipping,
                                                  sample_rate=q, seed=args.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = PoissonBatches(tokens, sample_rate=q, physical_batch_size=args.physical_batch_size,
                             seed=args.seed, steps=args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"corpus: {N} sequences of {args.seq_len} bytes from the stdlib; q={q:.3g}, δ={delta:.3g}, σ={sigma:.4g}")
    from tqdm import tqdm
    first = last = None
    start = time.time()
    with open(out / "metrics.jsonl", "w") as metrics, tqdm(total=args.steps, desc="train") as bar:
        for step, logical in enumerate(batches, 1):
            loss_sum = 0.0
            for (ids,), mask in logical.physical:
                loss_sum += float(engine.accumulate(ids, ids, mask=mask))
            engine.finalize(args.expected_batch_size)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss = loss_sum / max(logical.size, 1) / (args.seq_len - 1)
            eps = engine.epsilon(delta)
            tokens_s = step * args.expected_batch_size * args.seq_len / (time.time() - start)
            if logical.size:
                first = loss if first is None else first
                last = loss
            metrics.write(json.dumps({"step": step, "loss_per_token": loss, "batch": logical.size,
                                      "epsilon": eps}) + "\n")
            bar.set_postfix(loss=f"{loss:.3f}", eps=f"{eps:.2f}", tok_s=f"{tokens_s:.0f}")
            bar.update()
    print(f"done: {args.steps} steps, loss/token {first:.3f} -> {last:.3f}, ε = {engine.epsilon(delta):.3f} "
          f"at δ = {delta:.3g} (target {args.target_epsilon if args.sigma is None else 'n/a'}), "
          f"metrics in {out / 'metrics.jsonl'}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return train(args)
    except (ValueError, RuntimeError) as e:  # a clear one-liner, no traceback
        print(f"longshield-fx: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
