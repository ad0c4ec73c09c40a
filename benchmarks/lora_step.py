"""DP step with LoRA adapters against full fine-tuning, side by side in one run.

    python benchmarks/lora_step.py [--repeats 5]

An HF Llama (dim 256, 4 layers, vocab 8000) at T = 256, physical batch 4: the median time of
one ``engine.accumulate`` (forward, backward, per-sample gradients, norms, clipped sums) and
one ``finalize`` (noise), full fine-tuning against ``peft`` LoRA r = 8 on every linear layer
but the head, and the per-sample gradient floats the step materialises (B x trained params).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import longshield_fx as lf
from longshield_fx.data import LogicalBatch


def build(lora: int | None):
    cfg = transformers.LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    if lora:
        import peft

        lm = peft.get_peft_model(lm, peft.LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear",
                                                     lora_dropout=0.0, task_type="CAUSAL_LM"))
    return lf.CausalLMLoss(lm).train()


def measure(lora, repeats, B=4, T=256):
    model = build(lora)
    engine = lf.compile(model, config=lf.DPConfig(1.0, 1.0))
    ids = torch.randint(0, 8000, (B, T), generator=torch.Generator().manual_seed(0))
    logical = LogicalBatch(B, torch.arange(B), [], 0.01, 100.0)

    def step():
        start = time.perf_counter()
        engine.accumulate(ids, ids)
        mid = time.perf_counter()
        engine.finalize(logical)
        return mid - start, time.perf_counter() - mid

    step()  # capture and lowering
    times = [step() for _ in range(repeats)]
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (statistics.median(t[0] for t in times), statistics.median(t[1] for t in times), trained,
            sum(p.numel() for p in model.parameters()))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    full, lora = measure(None, args.repeats), measure(8, args.repeats)
    print("| fine-tuning | trained parameters | per-sample floats (B=4) | accumulate (median) | finalize (median) |")
    print("|---|---|---|---|---|")
    for name, (acc, fin, trained, total) in (("full", full), ("LoRA r=8, all-linear", lora)):
        print(f"| {name} | {trained:,} of {total:,} | {4 * trained:,} | {acc * 1e3:.0f} ms | {fin * 1e3:.1f} ms |")
    print(f"\nLoRA / full: accumulate {lora[0] / full[0]:.2f}x, finalize {lora[1] / full[1]:.3f}x, "
          f"per-sample floats {lora[2] / full[2]:.3f}x")


if __name__ == "__main__":
    main()
