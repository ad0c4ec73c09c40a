"""Context/data parallel plumbing for the engine: sharding, collectives outside the graph.

With no mesh everything here is the identity. With a mesh (dims "cp" and optionally "dp"):
- inputs are cut along the sequence into each cp rank's zig-zag shard, labels shifted over
  the FULL sequence first and global positions passed, so the per-rank graph computes the
  same loss terms as one process;
- ``finalize`` gathers the cp-sharded clipped sums (full gradients on every rank, for a
  replicated optimizer) and sums them over dp, before the noise is added once.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from .._torch import c10d
from ..losses import CausalLMLoss, ShardedCausalLMLoss, shift_labels
from ..ops.ring_attention import shard_sequence, zigzag_index


_PEER_FAILURE_WORDS = ("timed out", "timeout", "connection", "closed", "peer")


class Parallel:
    def __init__(self, mesh=None, cp_group=None, dp_group=None):
        self.mesh = mesh
        self.cp_group, self.dp_group = cp_group, dp_group
        self.cp = dist.get_world_size(cp_group) if cp_group is not None else 1
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0
        self.cp_group_name = cp_group.group_name if cp_group is not None else None

    @classmethod
    def from_mesh(cls, model: nn.Module, mesh) -> "Parallel":
        if mesh is None:
            return cls()
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if "cp" not in names:
            raise ValueError(f"compile: the mesh needs a dimension named 'cp' (and optionally 'dp'), got "
                             f"{names or 'unnamed dims'}; e.g. init_device_mesh('cpu', (2,), mesh_dim_names=('cp',))")
        unknown = set(names) - {"cp", "dp"}
        if unknown:
            raise ValueError(f"compile: unknown mesh dimensions {sorted(unknown)}; only 'cp' and 'dp' are supported")
        if not dist.is_initialized():
            raise ValueError("compile: a mesh needs torch.distributed initialised (run under torchrun)")
        if dist.get_world_size() != mesh.size():
            raise ValueError(f"compile: the mesh has {mesh.size()} ranks but the world has "
                             f"{dist.get_world_size()}; the mesh must cover every rank")
        device = next(model.parameters()).device
        if device.type != "cpu" and dist.get_backend() == "gloo":
            raise ValueError(f"compile: the model is on {device} but the process group uses gloo, whose "
                             "point-to-point transfers (ring attention) fail on device tensors; use "
                             "init_process_group('nccl') for GPUs, or keep the model on the CPU with gloo")
        cp_group = mesh["cp"].get_group()
        dp_group = mesh["dp"].get_group() if "dp" in names else None
        if dist.get_world_size(cp_group) > 1 and not isinstance(model, CausalLMLoss):
            raise ValueError("compile: context parallelism shards the sequence of a causal LM; wrap the model "
                             "in longshield_fx.CausalLMLoss")
        return cls(mesh, cp_group, dp_group)

    def __repr__(self) -> str:
        return f"cp={self.cp}, dp={self.dp}"

    # --- graph and inputs ------------------------------------------------------------------
    def capture_module(self, model: nn.Module) -> nn.Module:
        return ShardedCausalLMLoss(model) if self.cp > 1 else model

    def check_batch(self, batch) -> None:
        """Errors that must come before any collective runs."""
        if self.cp == 1:
            return
        if len(batch) != 2:
            raise ValueError("engine: under context parallelism pass (input_ids, labels), got "
                             f"{len(batch)} tensors")
        T = batch[0].shape[-1] if batch[0].dim() > 1 else 0
        if T % (2 * self.cp) != 0:
            raise ValueError(f"engine: sequence length {T} cannot be sharded over cp={self.cp}: it must be a "
                             f"multiple of 2*cp = {2 * self.cp} (two zig-zag chunks per rank); pad the "
                             "sequences with label -100")

    def shard(self, batch):
        if self.cp == 1:
            return batch
        input_ids, labels = batch  # (B, T) or (B, R, T): the sequence is the last dim
        ids = shard_sequence(input_ids, self.cp, self.cp_rank, dim=-1)
        shifted = shard_sequence(shift_labels(labels), self.cp, self.cp_rank, dim=-1)
        positions = zigzag_index(input_ids.shape[-1], self.cp, self.cp_rank).to(input_ids.device)
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
        dist.all_reduce(t, group=self.dp_group)
        return int(t.item())

    def sum_over_cp(self, t: torch.Tensor) -> torch.Tensor:
        if self.cp == 1:
            return t
        t = t.clone()
        dist.all_reduce(t, group=self.cp_group)
        return t

    def full_clipped_sum(self, total: torch.Tensor, shard_dim: int | None) -> torch.Tensor:
        if self.cp > 1 and shard_dim is not None:
            front = total.movedim(shard_dim, 0).contiguous()
            gathered = front.new_empty((front.shape[0] * self.cp, *front.shape[1:]))
            dist.all_gather_single(gathered, front, group=self.cp_group)
            total = gathered.movedim(0, shard_dim)
        if self.dp > 1:
            total = total.contiguous().clone()
            dist.all_reduce(total, group=self.dp_group)
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

    def communication_bytes(self, gm) -> dict[str, int]:
        out = {"reduce_scatter": 0, "all_reduce": 0, "all_gather": 0, "ring_attention": 0}
        if self.cp == 1:
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
                out["all_gather"] += nbytes[0] * self.cp  # the gathered buffer
            elif node.target == ring.ring_attention.default:
                out["ring_attention"] += (self.cp - 1) * (nbytes[1] + nbytes[2])
            elif node.target == ring.ring_attention_backward.default:
                k, v = vals[2], vals[3]
                grads_fp32 = 4 * (k.numel() + v.numel())
                out["ring_attention"] += (self.cp - 1) * (nbytes[2] + nbytes[3]) + self.cp * grads_fp32
        return out
