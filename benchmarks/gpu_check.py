"""What only a GPU can show: exactness of CUDA kernels, dropout's CUDA RNG, and llama3.2-1b steps.

``packed``, ``step`` and ``dropout`` ran on an H100 (torch 2.11) on 2026-11-26: results in
benchmarks/results/gpu_h100.md. ``zoo`` and ``step`` ran on an H200 on 2026-11-27 (``step`` again
after the int32 noise kernel and the LM head's bf16 GEMMs): results in benchmarks/results/gpu_h200.md.
``kernels``, ``step`` and ``packed --speed-only`` ran on an H200 on 2026-11-28 (sixth session there);
the document op's exactness (``attention_exactness``, then with a check of the ring's blocks that
``ring_merge_exactness`` has replaced), ``packed --speed-only`` and ``step`` again the same day, before
and after cuDNN took the op's one-document rows (seventh session).

    python benchmarks/gpu_check.py zoo [--workers 4] [--dtype float32|bfloat16] [arch ...]
    python benchmarks/gpu_check.py dropout
    python benchmarks/gpu_check.py step [--cases 4096:none 32768:block ...] [--budget S] [--profile]
        [--methods eager dp dp-packed dp-inductor dp-packed-inductor]
    python benchmarks/gpu_check.py packed [--device cuda] [--seq-lens 4096 16384 32768] [--speed-only]
    python benchmarks/gpu_check.py kernels [--device cuda] [--noise-values N] [--head V D POSITIONS]

``zoo``: every architecture of tests/hf_zoo.py (tiny random config, B=2, T=12) compiled on
``cuda`` in ``--dtype`` (fp32 with TF32 off) against a float64 per-sample autograd loop on the
CPU; beside ours, the same loop run on the GPU in that dtype: the dtype's own error, the floor.
Architectures are split over ``--workers`` processes (a CUDA error stays in its slice).

``dropout``: a GPT-2 with dropout 0.2 everywhere (attention dropout inside the fused CUDA
kernel) in train mode: our per-sample gradients against an eager forward of the whole batch
from the same seed followed by one backward per sample (so the same masks), and
checkpoint="block" / "selective" against no checkpointing, bitwise.

``step``: llama3.2-1b (1.24B parameters, fp32 master weights, bf16 compute), B=1, AdamW. eager:
``CausalLMLoss`` under autocast, ``.sum().backward()`` (block: ``torch.utils.checkpoint`` around
each layer). dp: ``accumulate`` + ``finalize`` (flat C=1, sigma=1, the secure ChaCha20 noise)
+ AdamW. One fresh process per (method, T, checkpoint): one warm-up step (capture), then the
median of 3 timed steps; peak = ``torch.cuda.max_memory_allocated`` over the timed steps;
``noise s`` = the median time of ``finalize`` (the noise draw, added to the gradient).
dp-packed: two rows of T holding documents of log-normal lengths (median T/2), 4 unit slots
(``compile(..., packed_units=4)``, ``PackedCausalLMLoss``; more slots run out of memory, see the
results); the table compares seconds per 1k document tokens, since it runs about twice dp's.

``packed``: packed documents on ``--device`` against the CPU. Exactness: the reference "small"
Llama (fp32, TF32 off) on a packed batch (4 rows of 256, 16 unit slots, documents split across
rows): each unit's gradient and norm against each unit run alone on the CPU in float64, and the clipped
sum (σ = 0) against the engine's own on the CPU; then all 16 units as one logical batch in the batches
of 4 and 2 rows packing makes (a graph per row count) against the same on the CPU. Each section runs
on if the one before fails. The document attention op (cp = 1) on CUDA in fp32
and bf16 against the float64 CPU oracle, beside SDPA under the boolean mask (the dtype's floor): a
row of many documents beside a row of one, then every row one document; its isolation; and the
ring's merge of two blocks on one process, in bf16, with flash's kernels and with cuDNN's. Speed
(alone with ``--speed-only``): one bf16 row (32 query / 8 KV heads, T, 64), forward + backward,
under about 9 documents and under ``step``'s layout (median T/2): causal SDPA, the op, SDPA under
the document mask, SDPA's causal kernel once per document, flex attention under a document block
mask; median of 5, and the peak memory of each.

``kernels``: the secure noise's compiled ChaCha20 words against OpenSSL's (bitwise) and its
Gaussian chunk against the CPU path; one chunk's time and a whole draw's (llama3.2-1b's parameter
count); the LM head's per-sample product (``ops/lm_head_loss._add_product``: bf16 factors into an
fp32 accumulator) against float64 and against the fp32 upcast, and both times.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _rel(ours: dict, ref: dict) -> float:
    import hf_zoo
    return hf_zoo.relative_error({n: t.detach().double().cpu() for n, t in ours.items()}, ref)


# ---------------------------------------------------------------- zoo

def zoo_worker(names: list[str], dtype: torch.dtype, out: str) -> None:
    import hf_zoo
    import longshield_fx as lf
    from longshield_fx.errors import UnsupportedModelError
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(2)
    results = {}
    for name in names:
        start = time.time()
        try:
            model = hf_zoo.build(name)
            ids, labels = hf_zoo.batch()
            ref64 = hf_zoo.loop_per_sample_grads(copy.deepcopy(model).double(), ids, labels)
        except Exception as e:
            results[name] = {"status": "no tiny config", "detail": f"{type(e).__name__}: {hf_zoo._first_line(e)}"}
            print(f"{name:28s} {results[name]}", file=sys.stderr, flush=True)
            continue
        try:
            gpu = copy.deepcopy(model).to("cuda", dtype)
            ids_c, labels_c = ids.cuda(), labels.cuda()
            loop = _rel(hf_zoo.loop_per_sample_grads(gpu, ids_c, labels_c), ref64)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine = lf.compile(gpu, config=lf.DPConfig(hf_zoo.CLIP, 0.0, compute_dtype=dtype))
                ours = engine.per_sample_grads(ids_c, labels_c)
                engine.accumulate(ids_c, labels_c)
                engine.finalize(hf_zoo._logical(len(ids)))
            per_sample = _rel(ours, ref64)
            clipped = _rel({n: p.grad for n, p in gpu.named_parameters() if p.requires_grad},
                           hf_zoo.clipped_sum(ref64, hf_zoo.CLIP))
            kernels = sorted({str(n.target).split(".")[1] for n in engine.lower(ids_c, labels_c).gm.graph.nodes
                              if "scaled_dot_product" in str(n.target) and "backward" not in str(n.target)})
            results[name] = {"status": "ran", "per_sample": per_sample, "clipped": clipped, "loop": loop,
                             "attention": ",".join(kernels)}
        except UnsupportedModelError as e:
            results[name] = {"status": "refused", "detail": hf_zoo._first_line(e)}
        except Exception as e:
            results[name] = {"status": "crash", "detail": f"{type(e).__name__}: {hf_zoo._first_line(e)}"}
        results[name]["seconds"] = round(time.time() - start, 1)
        print(f"{name:28s} {results[name]}", file=sys.stderr, flush=True)
    with open(out, "w") as f:
        json.dump(results, f)


def zoo(args) -> None:
    import hf_zoo
    names = args.names or hf_zoo.architectures()
    outs = [f"/tmp/gpu_zoo_{i}.json" for i in range(args.workers)]
    for out in outs:  # a warm machine keeps the last call's: never count them as this one's
        if os.path.exists(out):
            os.remove(out)
    procs = [subprocess.Popen([sys.executable, __file__, "_zoo_worker", f"--dtype={args.dtype}", f"--out={out}",
                              *names[i::args.workers]], stdout=sys.stderr) for i, out in enumerate(outs)]
    for p in procs:
        p.wait()
    results = {}
    for out in outs:
        if os.path.exists(out):
            results.update(json.load(open(out)))
    ran = {n: r for n, r in results.items() if r["status"] == "ran"}
    tol = 1e-5 if args.dtype == "float32" else 5e-2
    exact = [n for n, r in ran.items() if max(r["per_sample"], r["clipped"]) <= max(tol, 2 * r["loop"])]
    print(f"\n## Zoo on CUDA, {args.dtype} (transformers {__import__('transformers').__version__}, "
          f"torch {torch.__version__})\n")
    print(f"{len(results)} architectures: {len(ran)} ran, {len(exact)} of them within max({tol:g}, 2 x the "
          f"GPU loop's own error) of float64; " + ", ".join(
              f"{s} {sum(r['status'] == s for r in results.values())}" for s in ("refused", "crash", "no tiny config")))
    print("\n| architecture | ours per-sample rel | ours clipped rel | GPU autograd loop rel | attention kernel |")
    print("|---|---|---|---|---|")
    for n, r in sorted(results.items()):
        if r["status"] == "ran":
            print(f"| {n} | {r['per_sample']:.1e} | {r['clipped']:.1e} | {r['loop']:.1e} | {r['attention'] or '-'} |")
        elif r["status"] != "no tiny config":
            print(f"| {n} | {r['status']}: {r['detail'][:120].replace('|', '/')} | | | |")
    missing = sorted(set(names) - set(results))
    if missing:
        print(f"\nno result (worker died): {missing}")


# ---------------------------------------------------------------- dropout

def dropout(args) -> None:
    import transformers
    import longshield_fx as lf
    torch.backends.cuda.matmul.allow_tf32 = False

    def model_():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2, bos_token_id=None,
                                      eos_token_id=None, attn_implementation="sdpa")
        return lf.CausalLMLoss(transformers.GPT2LMHeadModel(cfg)).train().cuda()

    model = model_()
    ids = torch.randint(0, 128, (3, 32), generator=torch.Generator().manual_seed(0)).cuda()
    batch = (ids, ids.clone())

    def ours(seed, checkpoint=None):
        engine = lf.compile(model, checkpoint=checkpoint)
        gm = engine.lower(*batch, graph="per_sample").gm
        torch.manual_seed(seed)
        grads = engine.per_sample_grads(*batch)
        return grads, sorted({str(n.target) for n in gm.graph.nodes if "dropout" in str(n.target)
                              or "scaled_dot_product" in str(n.target)})

    torch.manual_seed(3)
    losses = model(*batch)
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    rows = [torch.autograd.grad(losses[b], params, retain_graph=True) for b in range(len(losses))]
    ref = {n: torch.stack([row[i] for row in rows]) for i, n in enumerate(names)}
    plain, ops = ours(3)
    other, _ = ours(4)
    print("\n## Dropout on CUDA (GPT-2, p=0.2 everywhere, train mode, fp32, B=3, T=32)\n")
    print(f"random ops in the captured graph: {ops}")
    print(f"ours vs same-masks eager oracle: worst rel {_rel(plain, {n: r.double().cpu() for n, r in ref.items()}):.1e}")
    print(f"another seed changes the masks: rel diff {_rel(other, {n: r.double().cpu() for n, r in plain.items()}):.1e}")
    for policy in ("block", "selective"):
        ck, _ = ours(3, policy)
        diff = max(float((ck[n] - plain[n]).abs().max()) for n in plain)
        print(f"checkpoint={policy} vs none: max abs diff {diff:.1e} ({'bitwise equal' if diff == 0 else 'DIFFERENT'})")


# ---------------------------------------------------------------- step

def step_worker(method: str, seq_len: int, checkpoint: str, out: str, device: str = "cuda",
                model_name: str = "llama3.2-1b") -> None:
    import functools
    import longshield_fx as lf
    from longshield_fx.data import LogicalBatch
    from longshield_fx.models.llama import Llama
    from torch.utils.checkpoint import checkpoint as torch_checkpoint
    dev = torch.device(device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()
    torch.manual_seed(0)
    with dev:
        lm = Llama.from_name(model_name)
    model = lf.CausalLMLoss(lm)
    ids = torch.randint(0, lm.cfg.vocab_size, (1, seq_len), device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    noise = []
    if method == "eager":
        if checkpoint == "block":
            for layer in lm.layers:
                layer.forward = functools.partial(torch_checkpoint, layer.forward, use_reentrant=False)

        tokens = seq_len

        def step():
            with torch.autocast(dev.type, torch.bfloat16):
                model(ids, ids).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        config = lf.DPConfig(1.0, 1.0, compute_dtype=torch.bfloat16)
        inductor = method.endswith("-inductor")  # the rewritten graph through inductor
        if method.removesuffix("-inductor") == "dp-packed":
            packed = _step_packed_batch(seq_len, lm.cfg.vocab_size)
            batch = tuple(t.to(dev) for t in packed.tensors())
            model = lf.PackedCausalLMLoss(lm)
            engine = lf.compile(model, config=config, checkpoint=None if checkpoint == "none" else checkpoint,
                                packed_units=4, inductor=inductor)
            size = len(packed.members)
            tokens = int((packed.units < 4).sum())
        else:
            engine = lf.compile(model, config=config, checkpoint=None if checkpoint == "none" else checkpoint,
                                inductor=inductor)
            batch, size = (ids, ids), 1
            tokens = seq_len
        logical = LogicalBatch(size=size, indices=torch.arange(size), physical=[], sample_rate=1e-3,
                               expected_size=1.0)

        def step():
            engine.accumulate(*batch)
            sync()
            start = time.perf_counter()
            engine.finalize(logical)
            sync()
            noise.append(time.perf_counter() - start)
            opt.step()
            opt.zero_grad(set_to_none=True)
    result = {"method": method, "T": seq_len, "checkpoint": checkpoint, "tokens": tokens}
    try:
        start = time.perf_counter()
        step()
        sync()
        result["first_s"] = time.perf_counter() - start
        noise.clear()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
        result.update(step_s=statistics.median(times), peak_gib=peak, noise_s=statistics.median(noise) if noise else None)
        if os.environ.get("GPU_CHECK_PROFILE"):  # one more step, its kernels by their own device time
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                sync()
            result["profile"] = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25,
                                                          max_name_column_width=60)
    except torch.OutOfMemoryError:
        result["error"] = "OOM"
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    with open(out, "w") as f:
        json.dump(result, f)


def step(args) -> None:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
               **({"GPU_CHECK_PROFILE": "1"} if args.profile else {}))
    rows, began = [], time.perf_counter()
    for case in args.cases:
        seq_len, checkpoint = int(case.split(":")[0]), case.split(":")[1]
        row = {}
        for method in args.methods:
            left = args.budget - (time.perf_counter() - began)  # checked per cell: a cell may take the timeout
            if left <= 0:
                print(f"budget of {args.budget} s spent: {method} at {case} not run", file=sys.stderr, flush=True)
                row[method] = {"error": "not run (budget)"}
                continue
            out = f"/tmp/gpu_step_{method}_{seq_len}_{checkpoint}.json"
            if os.path.exists(out):  # a warm machine keeps the last call's: never print it as this one's
                os.remove(out)
            try:
                subprocess.run([sys.executable, __file__, "_step_worker", method, str(seq_len), checkpoint, out],
                               env=env, timeout=max(1.0, min(args.timeout, left)))
            except subprocess.TimeoutExpired:
                pass
            try:
                row[method] = json.load(open(out))
            except (OSError, ValueError):  # none written, or cut off mid-write
                row[method] = {"error": "worker died or timed out"}
            profile = row[method].pop("profile", None)
            print(json.dumps(row[method]), file=sys.stderr, flush=True)
            if profile:
                print(f"\n### {method}, T={seq_len}, checkpoint={checkpoint}: one step's kernels\n\n```\n{profile}```\n",
                      flush=True)
        rows.append((seq_len, checkpoint, row))
    print(f"\n## llama3.2-1b, B=1, one step (torch {torch.__version__}, {torch.cuda.get_device_name()})\n")
    print("| T | checkpoint | eager s / peak GiB | DP s / peak GiB | DP / eager time | DP noise s | "
          "DP packed (2 rows) s / peak GiB | s per 1k tokens: eager, DP, DP packed |")
    print("|---|---|---|---|---|---|---|---|")

    def cell(r):
        return r["error"] if "error" in r else f"{r['step_s']:.3f} / {r['peak_gib']:.1f}"

    def per_k(r):
        return "-" if "error" in r else f"{1000 * r['step_s'] / r['tokens']:.4f}"
    for seq_len, checkpoint, row in rows:
        missing = {"error": "not run"}
        e, d, p = row.get("eager", missing), row.get("dp", missing), row.get("dp-packed", missing)
        ratio = f"{d['step_s'] / e['step_s']:.2f}" if "error" not in e and "error" not in d else "-"
        print(f"| {seq_len} | {checkpoint} | {cell(e)} | {cell(d)} | {ratio} | "
              f"{d.get('noise_s') and round(d['noise_s'], 3)} | {cell(p)} | {per_k(e)}, {per_k(d)}, {per_k(p)} |")
    for seq_len, checkpoint, row in rows:  # methods outside the table (e.g. dp-inductor, dp-packed-inductor)
        for method in set(row) - {"eager", "dp", "dp-packed"}:
            r = row[method]
            print(f"\n{method}, T={seq_len}, checkpoint={checkpoint}: {cell(r)}, {per_k(r)} s per 1k tokens"
                  + ("" if "error" in r else f" (first step, with its compile: {r['first_s']:.1f} s)"))


# ---------------------------------------------------------------- packed documents

def packed(args) -> None:
    if args.speed_only:
        return attention_speed(torch.device(args.device), args.seq_lens)
    import longshield_fx as lf
    from longshield_fx.data import LogicalBatch
    from longshield_fx.models.llama import Llama
    from longshield_fx.packing import pack_documents, unit_pieces
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device, T, C = torch.device(args.device), 256, 0.05
    torch.manual_seed(0)
    lm = Llama.from_name("small")
    g = torch.Generator().manual_seed(1)
    lengths = [[int(n) for n in torch.randint(2, 300, (int(k),), generator=g)]  # at most 4 pieces a unit
               for k in torch.randint(1, 3, (16,), generator=g)]
    units = [[torch.randint(0, lm.cfg.vocab_size, (n,), generator=g).tolist() for n in docs] for docs in lengths]
    oracle = copy.deepcopy(lm).double()

    def alone(docs_of: list) -> list:
        """Each unit's gradient alone on the CPU in float64, each piece a row of its own."""
        out = []
        for docs in docs_of:
            plain = lf.CausalLMLoss(oracle)
            oracle.zero_grad()
            for piece in unit_pieces(docs, T):
                x = torch.tensor([piece])
                plain(x, x).sum().backward()
            out.append({f"lm.{n}": p.grad.clone() for n, p in oracle.named_parameters()})
        return out

    def clipped_sum(pb, dev, slots):
        """(per-unit gradients, norms, clipped sum) of the engine on ``dev`` for the packed batch ``pb``."""
        model = lf.PackedCausalLMLoss(copy.deepcopy(lm).to(dev))
        tensors = tuple(t.to(dev) for t in pb.tensors())
        engine = lf.compile(model, config=lf.DPConfig(C, 0.0, insecure_seed=0), packed_units=slots)
        grads = engine.per_sample_grads(*tensors)
        engine.accumulate(*tensors)
        norms = engine.last_norms.double().cpu()
        engine.finalize(LogicalBatch(len(pb.members), torch.arange(len(pb.members)), [], 1.0, 1.0))
        return grads, norms, {f"lm.{n}": p.grad.double().cpu() for n, p in model.lm.named_parameters()}

    def against_each_unit_alone(title: str, docs_of: list, rows: int, slots: int) -> None:
        (pb, *_), _ = pack_documents(docs_of, seq_len=T, rows=rows, unit_slots=slots)
        refs = alone([docs_of[u] for u in pb.members])
        grads, norms, summed = clipped_sum(pb, device, slots)
        per_unit = max(_rel({n: g[slot] for n, g in grads.items()}, ref) for slot, ref in enumerate(refs))
        true = torch.tensor([sum(float(v.pow(2).sum()) for v in ref.values()) ** 0.5 for ref in refs])
        # The clip factor's denominator holds the float64 book-keeping rounding bound κ·A_u by design (clip.py),
        # so the clipped sum is compared with the same engine's on the CPU, not with an oracle's factor.
        clipped = _rel(summed, clipped_sum(pb, torch.device("cpu"), slots)[2])
        print(f"small Llama fp32, {title}: {len(refs)} units in {pb.input_ids.shape[0]} rows of {T}: per-unit "
              f"gradients rel. err. {per_unit:.2e}, norms {float(((norms[:len(refs)] - true).abs() / true).max()):.2e} "
              f"(against each unit alone, CPU float64); clipped sum {clipped:.2e} (against the engine on the CPU)\n",
              flush=True)

    def logical_batch(dev):
        """Every unit, in the batches of 4 and 2 rows packing makes, accumulated as one logical
        batch on ``dev``: (clipped sum, the row counts, captures)."""
        batches, _ = pack_documents(units, seq_len=T, rows=4, unit_slots=16)
        model = lf.PackedCausalLMLoss(copy.deepcopy(lm).to(dev))
        engine = lf.compile(model, config=lf.DPConfig(C, 0.0, insecure_seed=0), packed_units=16)
        for batch in batches:
            engine.accumulate(*(t.to(dev) for t in batch.tensors()))
        engine.finalize(LogicalBatch(len(units), torch.arange(len(units)), [], 1.0, 1.0))
        rows = [b.input_ids.shape[0] for b in batches]
        return {f"lm.{n}": p.grad.double().cpu() for n, p in model.lm.named_parameters()}, rows, engine.captures

    print(f"## packed documents on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}\n")
    try:  # each section alone: a failure here leaves the attention checks to run
        against_each_unit_alone("documents shorter than a row", units, rows=4, slots=16)
        # Long documents cut to whole rows: units of one length, one after another. With 4 slots the
        # head's per-unit gradient is its dense (slots, V, d) form (smaller than the rows form here),
        # whose units of whole rows are one batched product; the linear layers' products are one
        # bmm on the CPU and one grouped matmul on a GPU.
        whole_rows = [[torch.randint(0, lm.cfg.vocab_size, (2 * T,), generator=g).tolist()] for _ in range(4)]
        against_each_unit_alone("units of two whole rows each", whole_rows, rows=8, slots=4)
        whole, rows, captures = logical_batch(device)
        print(f"all {len(units)} units as one logical batch, in batches of {' / '.join(map(str, rows))} rows "
              f"({captures} captures): clipped sum rel. err. {_rel(whole, logical_batch(torch.device('cpu'))[0]):.2e} "
              f"(against the engine on the CPU)\n", flush=True)
    except Exception as e:
        print(f"packed engine on {device}: {type(e).__name__}: {str(e).splitlines()[0][:300]}\n", flush=True)
    if device.type != "cuda":
        return
    for section in (lambda: attention_exactness(device), lambda: attention_speed(device, args.seq_lens)):
        try:
            section()
        except Exception as e:
            print(f"packed on {device}: {type(e).__name__}: {str(e).splitlines()[0][:300]}\n", flush=True)


def _document_ids(B: int, T: int, docs: int, g: torch.Generator) -> torch.Tensor:
    """(B, T) ids of about ``docs`` documents per row (random cut points), numbered along each row."""
    starts = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        starts[b, torch.randperm(T, generator=g)[:docs]] = True
    starts[:, 0] = True
    return starts.cumsum(1)


def _gqa_sdpa(q, k, v, **kw):
    import torch.nn.functional as F
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), **kw)


def attention_exactness(device) -> None:
    """The document attention op (cp = 1) on CUDA against the float64 CPU oracle: fp32 (the
    masked memory-efficient kernel) and bf16 (flash over document runs), with SDPA under the
    boolean document mask in the same dtype on the GPU as the dtype's floor; and isolation."""
    import longshield_fx.ops.ring_attention  # noqa: F401  (registers the op)
    B, Hq, Hkv, T, D = 2, 8, 2, 1024, 64
    g = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(B, Hq, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    segments = _document_ids(B, T, 12, g)
    segments[0, :3] = torch.tensor([-3, -2, -1])  # three one-token documents
    segments[1] = 100  # a row that is one document: on Hopper cuDNN's, beside the varlen call for row 0

    def document_mask(segs):
        return ((segs[:, :, None] == segs[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril())[:, None]

    def ours(dtype, q=q, k=k, v=v, segs=segments):
        qq, kk, vv = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
        out, lse = torch.ops.longshield.ring_attention(qq, kk, vv, D**-0.5, "unused", 1, 0, segs.to(device))
        dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), grad.to(device, dtype))
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    def sdpa(dtype, segs, on=device):
        qq, kk, vv = (t.to(on, dtype).requires_grad_() for t in (q, k, v))
        out = _gqa_sdpa(qq, kk, vv, attn_mask=document_mask(segs).to(on))
        dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), grad.to(on, dtype))
        return dict(out=out, dq=dq, dk=dk, dv=dv)

    def oracle(segs):  # float64 on the CPU
        ref = {n: t.detach() for n, t in sdpa(torch.float64, segs, "cpu").items()}
        scores = q @ k.repeat_interleave(Hq // Hkv, 1).transpose(-1, -2) * D**-0.5
        ref["lse"] = scores.masked_fill(~document_mask(segs), float("-inf")).logsumexp(-1)
        return ref

    def err(got, ref):
        return {n: float((t.detach().double().cpu() - ref[n]).abs().max() / ref[n].abs().max()) for n, t in got.items()}
    print(f"\n## Document attention op on CUDA, one process (B={B}, {Hq} query / {Hkv} KV heads, T={T}, D={D}; "
          "row 0 about 15 documents, row 1 one), max abs error / max abs of the float64 CPU oracle\n")
    print("| dtype | kernel | out | lse | dq | dk | dv |")
    print("|---|---|---|---|---|---|---|")
    whole = torch.zeros_like(segments)
    refs = {id(segs): oracle(segs) for segs in (segments, whole)}
    for dtype, kernel, segs in ((torch.float32, "ours: memory-efficient + mask", segments),
                                (torch.bfloat16, "ours: flash over document runs (row 1: cuDNN on Hopper)", segments),
                                (torch.bfloat16, "ours, every row one document (cuDNN on Hopper)", whole)):
        ref = refs[id(segs)]
        for name, e in ((kernel, err(ours(dtype, segs=segs), ref)), ("SDPA + boolean mask (floor)",
                                                                     err(sdpa(dtype, segs), ref))):
            print(f"| {str(dtype)[6:]} | {name} | " + " | ".join(f"{e[n]:.1e}" if n in e else "-"
                                                                 for n in ("out", "lse", "dq", "dk", "dv")) + " |")
    # Isolation: another document's tokens replaced; every token outside it must not move.
    doc = segments == segments[0, T // 2]
    q2, k2, v2 = (torch.where(doc[:, None, :, None], torch.randn_like(t), t) for t in (q, k, v))
    for dtype in (torch.float32, torch.bfloat16):
        a, b = ours(dtype), ours(dtype, q2, k2, v2)
        keep = (~doc).to(device)[:, None, :]
        worst = max(float((a[n] - b[n]).abs()[keep.expand(a[n].shape[:3])].max()) for n in a)
        print(f"isolation, {str(dtype)[6:]}: largest change outside the replaced document {worst:.1e}")
    ring_merge_exactness(device)


def ring_merge_exactness(device) -> None:
    """The ring's merge on one process (one GPU cannot run the NCCL ring): the second half of a
    sequence's queries against its two key halves as two blocks (full, then causal), merged by
    log-sum-exp, and each block's backward given the merged out and lse, as the ring's backward
    is; bf16, with flash's kernels (what the ring runs) and cuDNN's (on Hopper), against float64
    on the CPU. cuDNN may take the ring's blocks once its errors here equal flash's."""
    from longshield_fx.ops import attention_kernels as ra
    B, H, c, D = 2, 8, 512, 64
    scale = D**-0.5
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, 2 * c, D, generator=g, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(B, H, c, D, generator=g, dtype=torch.float64)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q[:, :, c:], k, v))
    scores = (qq @ kk.transpose(-1, -2) * scale).masked_fill(~torch.ones(c, 2 * c, dtype=torch.bool).tril(c),
                                                               float("-inf"))
    ref_out = scores.softmax(-1) @ vv
    ref = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(ref_out, (qq, kk, vv), grad)), out=ref_out.detach(),
               lse=scores.logsumexp(-1).detach())
    print("\n## The ring's merge on one process, bf16 (B=2, 8 heads, two key blocks of 512, D=64): max abs error / "
          "max abs of float64 on the CPU\n")
    print("| kernels | out | lse | dq | dk | dv |")
    print("|---|---|---|---|---|---|")
    kernels = [("flash (the ring's)", ra._block_fwd, ra._block_bwd)]
    if ra._cudnn(q.to(device, torch.bfloat16)):
        kernels.append(("cuDNN", ra._cudnn_fwd, ra._cudnn_bwd))
    blocks = ((slice(0, c), False), (slice(c, None), True))
    for name, fwd, bwd in kernels:
        q_, k_, v_, go = (t.to(device, torch.bfloat16) for t in (q, k, v, grad))
        tail = q_[:, :, c:]
        parts = [fwd(tail, k_[:, :, b], v_[:, :, b], causal, scale) for b, causal in blocks]
        lse = torch.logaddexp(parts[0][1], parts[1][1])
        out = sum(o.float() * torch.exp(l - lse)[..., None] for o, l in parts).to(torch.bfloat16)
        grads = [bwd(go, tail, k_[:, :, b], v_[:, :, b], out, lse, causal, scale) for b, causal in blocks]
        got = dict(out=out, lse=lse, dq=sum(part[0].float() for part in grads),
                   dk=torch.cat([part[1] for part in grads], 2), dv=torch.cat([part[2] for part in grads], 2))
        print(f"| {name} | " + " | ".join(
            f"{float((got[n].double().cpu() - ref[n]).abs().max() / ref[n].abs().max()):.1e}"
            for n in ("out", "lse", "dq", "dk", "dv")) + " |")


def _step_packed_batch(T: int, vocab: int):
    """``step``'s packed batch: two rows of T holding documents of log-normal lengths (median T/2),
    4 unit slots (U + 1 copies of every parameter the cost model keeps per-sample, the embedding,
    must fit beside the model)."""
    from longshield_fx.packing import pack_documents
    g = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(16, generator=g) + torch.log(torch.tensor(T / 2))).long()
    units = [[torch.randint(0, vocab, (max(2, int(n)),), generator=g).tolist()] for n in lengths]
    (packed, *_), _ = pack_documents(units, seq_len=T, rows=2, unit_slots=4)
    return packed


def _step_documents(T: int) -> torch.Tensor:
    """(1, T) document ids of the row of ``step``'s packed batch that holds the most units (the
    other is one document, which cuDNN's causal kernel takes whole): its runs, and its padding
    (5% of it) as one more document here, where the step's op takes each padding token alone."""
    from longshield_fx.losses import document_segments
    packed = _step_packed_batch(T, 128256)
    row = max(range(2), key=lambda r: len(set(packed.units[r].tolist())))
    padding = packed.units[row:row + 1] == 4
    segments = document_segments(packed.position_ids[row:row + 1], packed.units[row:row + 1])[1]
    return torch.where(padding, int(segments[~padding].max()) + 1, segments)


def attention_speed(device, seq_lens) -> None:
    """Forward + backward of one row (bf16, llama3.2-1b's 32 query / 8 KV heads, D = 64) under two
    document layouts (about 9 documents; ``step``'s, median T/2): causal attention over the whole
    row (SDPA's choice), the document op (FA2 over the runs; on Hopper cuDNN for a row of one
    document), SDPA under the boolean document mask, SDPA's causal kernel called once per document,
    and flex attention (compiled) under a document block mask; median of 5 after a warm-up (which
    compiles flex). (cuDNN's variable-length kernel, ``aten._cudnn_attention_forward`` with
    cu_seqlens, ran here once on an H200 under torch 2.11: 50x slower than FA2 at 4k with wrong
    gradients, and an illegal memory access at 16k; see benchmarks/results/gpu_h200.md.)"""
    import longshield_fx.ops.ring_attention  # noqa: F401  (registers the op)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    g = torch.Generator().manual_seed(0)
    print("\n## Packed-document attention on CUDA, bf16, one row of (32 query / 8 KV heads, T, 64), forward + "
          "backward, median of 5\n")
    print("| T | layout: documents (Σ len² / T²) | causal (SDPA) ms / peak GiB | ours ms / peak GiB | "
          "SDPA + document mask ms / peak GiB | SDPA causal per document ms / peak GiB | flex + document block mask "
          "ms / peak GiB | ours / causal |")
    print("|---|---|---|---|---|---|---|---|")
    for seq_len in seq_lens:
        for layout, segments in (("9 docs", _document_ids(1, seq_len, 8, g)), ("step's", _step_documents(seq_len))):
            lengths = torch.unique_consecutive(segments[0], return_counts=True)[1].double()
            share = float(lengths.pow(2).sum()) / seq_len**2
            q = torch.randn(1, 32, seq_len, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(1, 8, seq_len, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(2))
            grad = torch.randn_like(q)
            seg = segments.to(device)
            bounds = [0, *lengths.long().cumsum(0).tolist()]
            doc = seg[0]
            block_mask = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), None, None,
                                           seq_len, seq_len, device=device)
            runs = {
                "causal": lambda: _gqa_sdpa(q, k, v, is_causal=True),
                "ours": lambda: torch.ops.longshield.ring_attention(q, k, v, 64**-0.5, "unused", 1, 0, seg)[0],
                "mask": lambda: _gqa_sdpa(q, k, v, attn_mask=((seg[0, :, None] == seg[0, None, :]) & torch.ones(
                    seq_len, seq_len, dtype=torch.bool, device=device).tril())),
                "per_doc": lambda: torch.cat([_gqa_sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
                                              for a, b in zip(bounds, bounds[1:])], 2),
                "flex": lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True, scale=64**-0.5),
            }
            cells = {}
            for name, fn in runs.items():
                try:
                    times = []
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    for _ in range(6):
                        for t in (q, k, v):
                            t.grad = None
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        fn().backward(grad)
                        torch.cuda.synchronize()
                        times.append(time.perf_counter() - start)
                    cells[name] = (statistics.median(times[1:]) * 1e3, torch.cuda.max_memory_allocated() / 2**30)
                except torch.OutOfMemoryError:
                    cells[name] = None
                except Exception as e:  # flex's compilation: the message, not the probe, is lost
                    print(f"{name} at T={seq_len}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", file=sys.stderr)
                    cells[name] = None
            fmt = {n: "OOM" if c is None else f"{c[0]:.2f} / {c[1]:.2f}" for n, c in cells.items()}
            if cells["ours"]:  # the others' outputs against ours (none to compare with where ours failed)
                with torch.no_grad():
                    reference = runs["ours"]().float()
                    for name in ("per_doc", "flex"):
                        if cells[name]:
                            fmt[name] += f" (out vs ours {float((runs[name]().float() - reference).abs().max()):.0e})"
            ratio = f"{cells['ours'][0] / cells['causal'][0]:.2f}" if cells["ours"] and cells["causal"] else "-"
            print(f"| {seq_len} | {layout}: {len(lengths)} ({share:.3f}) | {fmt['causal']} | {fmt['ours']} | "
                  f"{fmt['mask']} | {fmt['per_doc']} | {fmt['flex']} | {ratio} |", flush=True)


# ---------------------------------------------------------------- kernels

def kernels(args) -> None:
    """The secure noise kernel and the LM head's per-sample products on ``--device``."""
    from longshield_fx.ops import lm_head_loss as lm
    from longshield_fx.runtime import noise
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def median_s(f, reps):
        from _measure import median, timed
        f()  # warm-up: compiles
        sync()
        return median(timed(lambda: (f(), sync()), reps))

    print(f"\n## Kernels on {dev} (torch {torch.__version__})\n")
    key, nonce = os.urandom(32), (2**33 + 5).to_bytes(12, "little")
    fixed = noise._fixed_words(key, nonce, dev)
    counters = torch.arange(noise._CHUNK_BLOCKS, dtype=torch.int64, device=dev)
    words = torch.compile(noise._chacha_blocks, dynamic=False, fullgraph=True)(fixed, counters).cpu()
    u64 = noise._openssl_u64(key, nonce, noise._CHUNK_BLOCKS * 8)
    print("- compiled ChaCha20 words == OpenSSL's, one chunk of 2**20 blocks:",
          torch.equal(words, u64.view(torch.int32).to(torch.int64) & 0xFFFFFFFF))
    chunk = noise._compiled_gaussian_blocks()
    diff = (chunk(fixed, counters, True).cpu() - noise._gaussian((u64 >> 11) & (2**53 - 1), True)).abs().max()
    print(f"- compiled secure Gaussian chunk against the CPU path: max abs diff {float(diff):.1e}")
    print(f"- one chunk (secure): {1e3 * median_s(lambda: chunk(fixed, counters, True), 20):.3f} ms, median of 20")
    gen = noise.NoiseGenerator(dev, secure=True)
    print(f"- NoiseGenerator.normal({args.noise_values}) (secure): "
          f"{median_s(lambda: gen.normal(args.noise_values, 1.0), 3):.3f} s, median of 3")
    V, d, c = args.head
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(1, V, c, device=dev, dtype=torch.bfloat16, generator=g)
    b = torch.randn(1, c, d, device=dev, dtype=torch.bfloat16, generator=g)
    ours, upcast = torch.zeros(1, V, d, device=dev), torch.zeros(1, V, d, device=dev)
    lm._add_product(ours, a, b)
    upcast.baddbmm_(a.float(), b.float())
    rows = min(V, 4096)
    ref = torch.einsum("bvc,bcd->bvd", a[:, :rows].double(), b.double())

    def rel(x):
        return float((x[:, :rows].double() - ref).norm() / ref.norm())
    print(f"- LM head product (V={V}, d={d}, {c} positions, bf16 factors) against float64: ours {rel(ours):.1e}, "
          f"fp32 upcast {rel(upcast):.1e}; {1e3 * median_s(lambda: lm._add_product(ours, a, b), 10):.2f} ms against "
          f"{1e3 * median_s(lambda: upcast.baddbmm_(a.float(), b.float()), 10):.2f} ms, median of 10")


def main() -> None:
    if sys.argv[1] == "_zoo_worker":
        p = argparse.ArgumentParser()
        p.add_argument("--dtype")
        p.add_argument("--out")
        p.add_argument("names", nargs="*")
        a = p.parse_args(sys.argv[2:])
        return zoo_worker(a.names, getattr(torch, a.dtype), a.out)
    if sys.argv[1] == "_step_worker":
        return step_worker(*sys.argv[2:3], int(sys.argv[3]), *sys.argv[4:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    z = sub.add_parser("zoo")
    z.add_argument("--workers", type=int, default=4)
    z.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    z.add_argument("names", nargs="*")
    sub.add_parser("dropout")
    s = sub.add_parser("step")
    s.add_argument("--cases", nargs="+", default=[f"{t}:block" for t in (4096, 16384, 32768)],
                   help="T:checkpoint pairs, run in this order (default: block checkpointing, which fits each "
                   "method at 32k; at 32768:none dp-packed runs out of memory)")
    s.add_argument("--timeout", type=int, default=300, help="seconds per worker process")
    s.add_argument("--methods", nargs="+", default=["eager", "dp", "dp-packed"])
    s.add_argument("--budget", type=float, default=float("inf"),
                   help="start no cell after this many seconds, and stop a cell's worker when they are spent")
    s.add_argument("--profile", action="store_true", help="also print one step's kernels (torch.profiler) per cell")
    k = sub.add_parser("packed")
    k.add_argument("--device", default="cuda")
    k.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 32768])
    k.add_argument("--speed-only", action="store_true", help="only the attention kernels' speed")
    n = sub.add_parser("kernels")
    n.add_argument("--device", default="cuda")
    n.add_argument("--noise-values", type=int, default=1_235_814_400, help="default: llama3.2-1b's parameters")
    n.add_argument("--head", type=int, nargs=3, default=[128256, 2048, 1024], metavar=("V", "D", "POSITIONS"))
    args = p.parse_args()
    {"zoo": zoo, "dropout": dropout, "step": step, "packed": packed, "kernels": kernels}[args.what](args)


if __name__ == "__main__":
    main()
