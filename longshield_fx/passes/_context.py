"""What passes read (``PassContext``) and where they record what they learn (node meta keys)."""
from __future__ import annotations

from dataclasses import dataclass

from ..capture import CapturedGraph


@dataclass(frozen=True)
class PassContext:
    """The inputs every pass may read; passes never write to it.

    ``sp_*``: the sequence-parallel group, every rank holding part of a sample's sequence
    (size 1: one process); within it ``cp_*`` is the attention ring and ``hp_*`` the head
    all-to-all of 2D attention (sp = cp x hp). ``checkpoint``: the activation-checkpointing
    policy (None, "block" or "selective"). ``fsdp_*``: parameters and clipped sums are
    sharded along dim 0 over that group (``runtime.fsdp``), replicated over the replica group;
    ``reshard_after_forward``: the backward gathers each parameter again (True) or reads the
    forward's gather (False; ``gather_params``). ``packed_units``: U > 0 when rows hold packed
    documents (``packed_tokens.Packing``); the samples are then the U unit slots, not the rows.
    """

    captured: CapturedGraph
    batch_size: int
    config: object = None
    sp_size: int = 1
    sp_group_name: str | None = None
    sp_rank: int = 0
    cp_size: int = 1
    cp_group_name: str | None = None
    cp_inner: int = 0  # double ring: inner ring size w (0: one ring)
    hp_size: int = 1
    hp_group_name: str | None = None
    checkpoint: str | None = None
    fsdp_size: int = 1  # shards of each parameter (1: parameters enter the graph whole)
    fsdp_group_name: str | None = None
    fsdp_replica_group_name: str | None = None  # hybrid sharding: the ranks holding the same shard
    fsdp_rank: int = 0  # this rank's shard
    fsdp_sp_ranks: tuple = ()  # the sp rank of each member of the fsdp group, in group order
    reshard_after_forward: bool = True
    packed_units: int = 0  # packed documents: U unit slots, the last input maps each token to one (0: not packed)

    def param_meta(self, name: str) -> dict:
        """The ``meta`` dict of trainable parameter ``name``'s placeholder, where passes
        record what they learn about it (keys below)."""
        return self.captured.param_placeholder(name).meta


# Keys of a parameter placeholder's meta, written by the pass named:
PER_SAMPLE_GRAD = "per_sample_grad"  # per_sample (shard_grads replaces it): a PerSampleGrad
PER_SAMPLE_RULE = "per_sample_rule"  # per_sample: the rule(s) that formed it, e.g. "linear"
NORM_METHOD = "norm_method"  # ghost_norm: how clip computes its per-sample norm and clipped sum, and why
CP_SHARD_DIM = "cp_shard_dim"  # shard_grads: parameter dim its gradient is sharded along over sp, or None


# Keys of a node's meta:
KEEP_SELECTIVE = "keep_under_selective"  # context_parallel: selective checkpointing keeps this 2D-attention value
