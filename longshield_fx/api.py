"""``compile``: wires capture -> passes -> runtime."""
from __future__ import annotations

import torch
from torch import nn

from ._allocator import keep_freed_memory
from .config import DPConfig
from .runtime.engine import Engine


def compile(model: nn.Module, mesh=None, *, config: DPConfig | None = None, checkpoint=None,
            inner_ring: int | None = None, fsdp=None, reshard_after_forward: bool = True,
            disable_passes=(), packed_units: int = 0, inductor: bool = False) -> Engine:
    """Compile ``model`` into a DP training engine.

    ``model.forward(*batch)`` must return per-sample losses of shape (B,); the objective is
    their sum (``longshield_fx.CausalLMLoss`` wraps a causal LM this way). Capture happens
    at the first call of the engine.

    ``mesh``: a ``torch.distributed.DeviceMesh`` for sequence-parallel training under
    torchrun, with dims ``"cp"`` (ring attention), ``"hp"`` (head-parallel all-to-all:
    LoongTrain's 2D attention, hp x cp) or both, and optionally ``"dp"``; the model must then
    be a ``CausalLMLoss``. Every rank passes the same full batch; the engine keeps its piece.
    The mesh's dim order is the placement: the last dim's ranks are adjacent (("cp", "hp"):
    head-first, hp groups inside a node; ("hp", "cp"): context-first).

    ``inner_ring``: w for double-ring attention (cp/w inner rings of w adjacent cp ranks,
    joined by an outer ring; it must divide cp). None: one ring of cp ranks.

    ``fsdp``: mesh dims to shard model states over (ZeRO-3 / FSDP, in the graph): ``("dp",
    "cp")`` shards every parameter along dim 0 over all those ranks; ``("cp",)`` shards within
    each cp group and replicates over dp (hybrid sharding). The model's parameters become
    ``DTensor`` shards when ``compile`` returns, so an optimizer built afterwards
    (``torch.optim.AdamW(model.parameters())``) keeps sharded states; ``param.grad`` after
    ``finalize`` is the noisy shard. None: every rank holds everything.

    ``reshard_after_forward`` (with ``fsdp`` only): True, the backward gathers each
    parameter again, so no whole parameter outlives its forward use (the least memory);
    False, the backward reads the forward's gather: one gather per parameter per step, every
    parameter whole from the forward to its backward use (FSDP2's option of that name).

    ``checkpoint``: None, ``"block"`` (recompute each transformer block's activations in the
    backward) or ``"selective"`` (as block, but keep attention outputs and their lse).

    ``packed_units``: U > 0 when rows hold packed documents (``longshield_fx.pack_documents``):
    the last tensor of every batch is then the (B, T) unit slot of each token, in [0, U], U
    for padding, and the samples (clipped, counted, accounted) are the U unit slots, not the
    rows; ``model.forward`` returns each row's summed loss (``PackedCausalLMLoss``). It runs on
    one process or over "dp" and "cp" mesh dims, with or without fsdp (each dp group packs its
    own share of the units: ``LogicalBatch.share``; under cp the documents' attention runs round
    the ring); an "hp" dim is refused with it for now.

    ``disable_passes``: names of passes to leave out of the pipeline, for experiments and
    benchmarks (e.g. ``("overlap",)``); ``print(engine)`` shows the pipeline.

    ``inductor``: run the rewritten train graph through ``torch.compile`` (inductor; one
    process, no mesh): its elementwise work (masks, clip factors, norms' squares) fused, the
    custom ops (document attention, per-unit products, the LM head) called as they are. The
    results equal the plain graph's within float rounding; the first step pays the compile
    (about 40 s for the ``tiny`` reference model's packed graph on a 2-core CPU), later ones run
    faster there: 7-12% packed, 14-23% unpacked (``tiny`` and ``small``,
    ``benchmarks/packed_slot_cost.py --compiled``). Off by default: a short run loses.

    A model with parameters on the CPU sets glibc's malloc to reuse freed memory (once per
    process: ``longshield_fx._allocator``), which the step's large temporaries need to run
    without a page fault per fresh page.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile: model must be an nn.Module, got {type(model).__name__}")
    if config is not None and not isinstance(config, DPConfig):
        raise TypeError(f"compile: config must be a longshield_fx.DPConfig, got {type(config).__name__}")
    if checkpoint not in (None, "block", "selective"):
        raise ValueError(f"compile: checkpoint must be None, 'block' or 'selective', got {checkpoint!r}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("compile: the model has no trainable parameters (all requires_grad=False)")
    _check_packed_units(packed_units, config, mesh)
    if inductor and mesh is not None:
        raise ValueError("compile: inductor=True runs on one process (no mesh) for now: the graph's collectives "
                         "have not been checked through inductor here; way out: inductor=False")
    if any(p.device.type == "cpu" for p in model.parameters()):
        keep_freed_memory()
    return Engine(model, config, mesh, checkpoint, disable_passes, inner_ring=inner_ring, fsdp=fsdp,
                  reshard_after_forward=reshard_after_forward, packed_units=packed_units, inductor=bool(inductor))


def _check_packed_units(packed_units, config: DPConfig | None, mesh) -> None:
    """``packed_units`` is 0 (not packed) or U > 0, and a packed run's dtype and mesh are ones it runs in."""
    if packed_units is True or packed_units != 0:  # 0 (or False): not packed
        if not (isinstance(packed_units, int) and not isinstance(packed_units, bool) and packed_units > 0):
            raise ValueError(f"compile: packed_units must be an int > 0 (unit slots per physical batch), "
                             f"got {packed_units!r}")
        if config is not None and config.compute_dtype == torch.float16:
            # Attention weighs another unit's tokens by an exact 0, and 0 * inf is nan: one unit that
            # overflows fp16 would turn the other units of its rows non-finite (and so drop them).
            raise ValueError("compile: packed documents do not run in float16 (one unit's overflow would reach the "
                             "other units of its rows through attention's zero weights); use bfloat16 or float32")
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if "hp" in names and mesh.size(names.index("hp")) > 1:
            raise ValueError("compile: packed documents (packed_units) run over 'dp' and 'cp' mesh dims (with or "
                             "without fsdp), not yet over an 'hp' dim (2D attention); way out: a mesh without 'hp', "
                             "or unpacked batches (CLI --no-pack)")
