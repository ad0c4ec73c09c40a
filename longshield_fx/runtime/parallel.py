"""Sequence/data parallel plumbing for the engine: sharding, collectives outside the graph.

With no mesh everything here is the identity. With a mesh (dims "cp", "hp", "dp"; any of
them may be left out, but one of "cp" / "hp" must be there):
- the sequence-parallel ("sp") group is every rank holding part of one sequence: hp x cp
  ranks. Inputs are cut along the sequence into each cp rank's zig-zag shard, that shard
  into hp contiguous pieces (the head all-to-all of 2D attention puts them back together),
  labels shifted over the FULL sequence first and global positions passed, so the per-rank
  graph computes the same loss terms as one process;
- without sharded model states (``runtime.fsdp``), ``finalize`` gathers the sp-sharded clipped
  sums (full gradients on every rank, for a replicated optimizer) and sums them over dp,
  before the noise is added once.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from .._torch import c10d, flattened_group, gloo_worker_threads, resolve_process_group
from ..losses import (CausalLMLoss, PackedCausalLMLoss, ShardedCausalLMLoss, ShardedPackedCausalLMLoss,
                      document_segments, shift_labels)
from ..ops.ring_schedule import zigzag_index


_PEER_FAILURE_WORDS = ("timed out", "timeout", "connection", "closed", "peer")
_DIMS = ("dp", "cp", "hp")
_SEQUENCE_DIMS = ("cp", "hp")  # the sp group: every rank holding part of one sequence


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


class Parallel:
    """The groups of a mesh: ``cp`` (the attention ring), ``hp`` (the head all-to-all),
    ``sp`` (both: per-sample gradient reduce-scatter, norms, losses) and ``dp``.

    Kept by name, resolved when used: an engine outliving ``destroy_process_group`` (a Trainer
    script's, held to the end) must not keep a group, and its threads, alive into interpreter
    finalization (``_torch.destroy_process_groups``)."""

    def __init__(self, mesh=None, cp_group=None, dp_group=None, hp_group=None, sp_group=None,
                 inner_ring: int | None = None, packed: bool = False):
        self.mesh = mesh
        self.packed = packed  # batches of packed documents: (input_ids, labels, position_ids, units)
        sp_group = sp_group if sp_group is not None else (cp_group if hp_group is None else hp_group)
        self.cp, self.dp, self.hp, self.sp = _size(cp_group), _size(dp_group), _size(hp_group), _size(sp_group)
        self.cp_rank, self.hp_rank, self.sp_rank = _rank(cp_group), _rank(hp_group), _rank(sp_group)
        self.cp_group_name, self.dp_group_name, self.hp_group_name, self.sp_group_name = (
            g.group_name if g is not None else None for g in (cp_group, dp_group, hp_group, sp_group))
        self.inner_ring = inner_ring or self.cp  # w: the double ring's inner ring size (cp: one ring)
        if self.cp % self.inner_ring:
            raise ValueError(f"compile: inner_ring={inner_ring} must divide cp={self.cp} (the mesh's 'cp' size)")

    @classmethod
    def from_mesh(cls, model: nn.Module, mesh, inner_ring: int | None = None, packed: bool = False) -> "Parallel":
        if mesh is None:
            if inner_ring is not None:
                raise ValueError("compile: inner_ring needs a mesh with a 'cp' dimension")
            return cls(packed=packed)
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        unknown = set(names) - set(_DIMS)
        if unknown or not {"cp", "hp"} & set(names):
            raise ValueError(f"compile: the mesh needs a dimension named 'cp' (ring attention) or 'hp' (head "
                             f"all-to-all), and optionally 'dp', got {names or 'unnamed dims'}; e.g. "
                             "init_device_mesh('cpu', (2,), mesh_dim_names=('cp',)) or (2, 2) with ('cp', 'hp')")
        if not dist.is_initialized():
            raise ValueError("compile: a mesh needs torch.distributed initialised (run under torchrun)")
        if dist.get_world_size() != mesh.size():
            raise ValueError(f"compile: the mesh has {mesh.size()} ranks but the world has "
                             f"{dist.get_world_size()}; the mesh must cover every rank")
        device = next(model.parameters()).device
        if device.type != "cpu" and gloo_worker_threads(dist.group.WORLD):  # any gloo
            raise ValueError(f"compile: the model is on {device} but the process group uses gloo, whose "
                             "point-to-point transfers (ring attention) fail on device tensors; use "
                             "init_process_group('nccl') for GPUs, or keep the model on the CPU with gloo")
        groups = {n: mesh[n].get_group() for n in names}
        sequence_dims = tuple(n for n in names if n in _SEQUENCE_DIMS)
        sp_group = flattened_group(mesh, sequence_dims)
        loss = PackedCausalLMLoss if packed else CausalLMLoss
        if dist.get_world_size(sp_group) > 1 and not isinstance(model, loss):
            raise ValueError("compile: context parallelism shards the sequence of a causal LM; wrap the model "
                             f"in longshield_fx.{loss.__name__}")
        return cls(mesh, groups.get("cp"), groups.get("dp"), groups.get("hp"), sp_group, inner_ring, packed)

    def __repr__(self) -> str:
        return (f"cp={self.cp}, dp={self.dp}" + (f", hp={self.hp}" if self.hp > 1 else "")
                + (f", inner_ring={self.inner_ring}" if self.inner_ring != self.cp else ""))

    # --- graph and inputs ------------------------------------------------------------------
    def capture_module(self, model: nn.Module) -> nn.Module:
        if self.sp == 1:
            return model
        return ShardedPackedCausalLMLoss(model) if self.packed else ShardedCausalLMLoss(model)

    def check_batch(self, batch) -> None:
        """Errors that must come before any collective runs."""
        if self.sp == 1:
            return
        want = 4 if self.packed else 2
        if len(batch) != want:
            what = "(input_ids, labels, position_ids, units) of packed documents" if self.packed else "(input_ids, labels)"
            raise ValueError(f"engine: under context parallelism pass {what}, got {len(batch)} tensors")
        T = batch[0].shape[-1] if batch[0].dim() > 1 else 0
        multiple = 2 * self.cp * self.hp
        if T % multiple != 0:
            over, what = (f"cp={self.cp}", "2*cp") if self.hp == 1 else (f"cp={self.cp} x hp={self.hp}", "2*cp*hp")
            cut = f", cut into {self.hp} head-parallel pieces" if self.hp > 1 else ""
            raise ValueError(f"engine: sequence length {T} cannot be sharded over {over}: it must be a multiple of "
                             f"{what} = {multiple} (two zig-zag chunks per cp rank{cut}); pad the sequences with "
                             "label -100")

    def sp_rank_of(self, rank: int) -> int:
        """Global ``rank``'s index in its sp group: row-major over its mesh coordinates along
        the sequence dims ("cp", "hp"), as ``flattened_group`` orders the group."""
        if self.mesh is None:
            return 0
        where = (self.mesh.mesh == rank).nonzero()[0].tolist()
        index = 0
        for name, size, at in zip(self.mesh.mesh_dim_names, self.mesh.shape, where):
            if name in _SEQUENCE_DIMS:
                index = index * size + at
        return index

    def positions(self, T: int) -> torch.Tensor:
        """Global positions of this rank's tokens: its hp piece of its cp rank's zig-zag shard."""
        shard = zigzag_index(T, self.cp, self.cp_rank)
        piece = shard.shape[0] // self.hp
        return shard[self.hp_rank * piece:(self.hp_rank + 1) * piece]

    def shard(self, batch):
        if self.sp == 1:
            return batch
        positions = self.positions(batch[0].shape[-1]).to(batch[0].device)
        if self.packed:  # what needs whole rows first: segments, and labels shifted with no cross-segment target
            input_ids, labels, position_ids, units = batch
            starts, segments = document_segments(position_ids, units)
            shifted = shift_labels(labels.masked_fill(starts, -100))
            return tuple(t.index_select(-1, positions) for t in (input_ids, shifted, position_ids, segments, units))
        input_ids, labels = batch  # (B, T) or (B, R, T): the sequence is the last dim
        ids = input_ids.index_select(-1, positions)
        shifted = shift_labels(labels).index_select(-1, positions)
        return ids, shifted, positions.expand(ids.shape).contiguous()

    @contextlib.contextmanager
    def model_rng(self):
        """Random ops of the model (dropout) draw independently on every rank.

        Ranks usually seed torch alike, so without this every cp rank would drop the same
        pattern over its own tokens. One draw from the default generator, equal on all ranks
        so they stay in step, seeds a per-rank stream for the step. The DP noise never comes
        from here (``runtime.noise`` has its own secret stream).
        """
        if self.mesh is None or self.mesh.size() == 1:
            yield
            return
        step_seed = int(torch.randint(0, 2**62, (1,)))
        device_type = self.mesh.device_type
        with torch.random.fork_rng(**({} if device_type == "cpu" else {"device_type": device_type})):
            torch.manual_seed(hash((step_seed, dist.get_rank())) & (2**63 - 1))
            yield

    # --- collectives outside the graph --------------------------------------------------------
    def sum_over_dp(self, count: int) -> int:
        if self.dp == 1:
            return count
        t = torch.tensor([count], dtype=torch.int64, device=self.mesh.device_type)
        dist.all_reduce(t, group=resolve_process_group(self.dp_group_name))
        return int(t.item())

    def sum_over_sp(self, t: torch.Tensor) -> torch.Tensor:
        if self.sp == 1:
            return t
        t = t.clone()
        dist.all_reduce(t, group=resolve_process_group(self.sp_group_name))
        return t

    def full_clipped_sum(self, total: torch.Tensor, shard_dim: int | None) -> torch.Tensor:
        if self.sp > 1 and shard_dim is not None:
            front = total.movedim(shard_dim, 0).contiguous()
            gathered = front.new_empty((front.shape[0] * self.sp, *front.shape[1:]))
            dist.all_gather_single(gathered, front, group=resolve_process_group(self.sp_group_name))
            total = gathered.movedim(0, shard_dim)
        if self.dp > 1:
            total = total.contiguous().clone()
            dist.all_reduce(total, group=resolve_process_group(self.dp_group_name))
        return total

    @contextlib.contextmanager
    def collective_errors(self):
        if self.mesh is None:
            yield
            return
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            text = str(e).lower()
            if not isinstance(e, dist.DistError) and not any(w in text for w in _PEER_FAILURE_WORDS):
                raise
            raise RuntimeError(
                f"longshield_fx: a peer rank probably died or stopped calling the engine: a collective over "
                f"the mesh ({self}) failed (waits are bounded by init_process_group(timeout=...)): {e}") from e

    def communication_bytes(self, gm, group_ranks: dict[str, int] | None = None) -> dict[str, int]:
        """Bytes each rank sends per step, by kind, read off the graph's collective nodes: a
        reduce-scatter or all-reduce counts its input, an all-gather the gathered buffer, an
        all-to-all the part of its input that leaves the rank ((hp-1)/hp for the head
        all-to-alls; ``group_ranks``: this rank's index in any other all-to-all's group), ring attention its
        (cp-1) K/V hops (and in the backward the fp32 dK/dV accumulators' hops)."""
        out = {"reduce_scatter": 0, "all_reduce": 0, "all_gather": 0, "all_to_all": 0, "ring_attention": 0}
        if self.mesh is None:
            return out
        ring = torch.ops.longshield
        for node in gm.graph.nodes:
            vals = [a.meta.get("val") for a in node.args if isinstance(a, torch.fx.Node)]
            nbytes = [v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor)]
            if node.target == c10d.reduce_scatter_tensor.default:
                out["reduce_scatter"] += nbytes[0]
            elif node.target == c10d.all_reduce.default:
                out["all_reduce"] += nbytes[0]
            elif node.target == c10d.all_gather_into_tensor.default:
                out["all_gather"] += nbytes[0] * node.args[1]  # the gathered buffer
            elif node.target == c10d.all_to_all_single.default:  # what leaves: every split but this rank's
                sent, group = node.args[2], node.args[3]
                me = self.hp_rank if group == self.hp_group_name else (group_ranks or {})[group]
                out["all_to_all"] += nbytes[0] * (sum(sent) - sent[me]) // sum(sent)
            elif node.target == ring.ring_attention.default and self.cp > 1:
                out["ring_attention"] += (self.cp - 1) * (nbytes[1] + nbytes[2])
            elif node.target == ring.ring_attention_backward.default and self.cp > 1:
                k, v = vals[2], vals[3]
                grads_fp32 = 4 * (k.numel() + v.numel())
                # dK/dV hops: cp around one ring; a double ring adds the outer ring's cp/w
                outer = self.cp // self.inner_ring
                accumulator_hops = self.cp + (outer if 1 < self.inner_ring < self.cp else 0)
                out["ring_attention"] += (self.cp - 1) * (nbytes[2] + nbytes[3]) + accumulator_hops * grads_fp32
        return out
