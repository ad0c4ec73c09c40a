"""Sharded model states (ZeRO-3 / FSDP, and hybrid sharding) for the engine.

``compile(..., fsdp=dims)`` shards every parameter along dim 0 over the mesh dims ``dims``
and replicates it over the others (FSDP2's layout: ``Shard(0)`` on a 1-D mesh, or
``(Replicate(), Shard(0))`` on a 2-D (replicate, shard) mesh for hybrid sharding). The
model's parameters become those ``DTensor``s, so an optimizer built afterwards keeps
sharded states too. The captured graph takes each rank's local shard and all-gathers it
before use (the ``gather_params`` pass); its clipped sums leave the graph already reduced
to the local shard (``scatter_clipped_sums``).

Uneven shards: a dim 0 of p rows is cut as ``torch.chunk`` (and DTensor) cuts it, c =
ceil(p / n) rows per rank, the last ranks holding fewer or none. The graph sees every
shard padded to c rows (collectives need equal sizes); ``local`` pads, ``to_param_grad``
drops the padding again.

``reshard_after_forward`` (FSDP2's option of that name): True, the graph gathers each
parameter again for the backward, so no whole parameter lives from the forward to the
backward; False, the backward reads the forward's gather (one gather per parameter, every
parameter whole between the forward and its backward use). The ``gather_params`` pass.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from .._torch import FakeTensorMode, sharding_mesh, swapped_tensors
from ..errors import UnsupportedModelError


class Sharding:
    """How model states are sharded: ``n`` shards over ``group_name`` (this rank holds shard
    ``index``; ``members[i]`` is the global rank holding shard i), replicated over
    ``replica_group_name`` (None: every rank holds its own shard);
    whether the backward gathers again (``reshard_after_forward``)."""

    def __init__(self, mesh, dims: tuple[str, ...], reshard_after_forward: bool = True):
        # DTensor is imported here and in the methods below, not with this module: it is 0.7 s
        # of every process's start, and only a sharded engine uses it.
        from torch.distributed.tensor import Replicate, Shard

        self.reshard_after_forward = reshard_after_forward
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [d for d in dims if d not in names]
        if not dims or unknown or len(set(dims)) != len(dims):
            raise ValueError(f"compile: fsdp names the mesh dims to shard model states over, e.g. ('dp', 'cp') "
                             f"(every rank) or ('cp',) (hybrid: sharded within cp, replicated over dp); got "
                             f"{dims!r} for a mesh with dims {names}")
        shard = tuple(n for n in names if n in dims)  # the mesh's order decides the shard index
        sizes = dict(zip(names, mesh.shape))
        replicate = tuple(n for n in names if n not in dims and sizes[n] > 1)
        self.dims, self.replicate_dims = shard, replicate
        try:
            self.mesh, at = sharding_mesh(mesh, replicate, shard)
        except ValueError as e:
            raise ValueError(f"compile: fsdp={dims!r} cannot be laid out on this mesh: {e}. Way out: order the "
                             "mesh dims so the sharded ones are adjacent, e.g. ('dp', 'cp', 'hp') with "
                             "fsdp=('cp', 'hp')") from e
        if replicate:
            self.placements = (Shard(0), Replicate()) if at == 0 else (Replicate(), Shard(0))
        else:
            self.placements = (Shard(0),)
        group = self.mesh.get_group(at)  # kept by name, as Parallel keeps its groups
        self.group_name = group.group_name
        self.replica_group_name = self.mesh.get_group(1 - at).group_name if replicate else None
        self.n = dist.get_world_size(group)
        self.index = dist.get_rank(group)
        self.members = dist.get_process_group_ranks(group)  # global ranks, by shard

    @classmethod
    def from_mesh(cls, mesh, dims, reshard_after_forward: bool = True) -> "Sharding | None":
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"compile: reshard_after_forward must be True or False, got {reshard_after_forward!r}")
        if dims is None:
            if not reshard_after_forward:
                raise ValueError("compile: reshard_after_forward=False keeps gathered parameters for the backward, "
                                 "which only sharded model states have; pass fsdp=... too, or leave it out")
            return None
        if mesh is None:
            raise ValueError("compile: fsdp shards model states over mesh dims; pass a mesh too "
                             "(e.g. init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'cp')))")
        if isinstance(dims, str):
            dims = (dims,)
        return cls(mesh, tuple(dims), reshard_after_forward)

    def __repr__(self) -> str:
        kind = f"hybrid, replicated over {'x'.join(self.replicate_dims)}" if self.replicate_dims else "ZeRO-3"
        kept = "" if self.reshard_after_forward else ", reshard_after_forward=False"
        return f"fsdp={'x'.join(self.dims)} ({self.n} shards, {kind}{kept})"

    # --- the model ---------------------------------------------------------------------------
    def shard_model(self, model: nn.Module) -> None:
        """Replace every parameter by its ``DTensor`` (rank 0's values; a tied weight stays
        one parameter). Parameters already sharded this way are kept: compiling a model twice
        is allowed."""
        new: dict[int, nn.Parameter] = {}
        for module_name, module in model.named_modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) not in new:
                    new[id(p)] = self._sharded(p, f"{module_name}.{name}".lstrip("."))
                module._parameters[name] = new[id(p)]

    def unshard_model(self, model: nn.Module) -> None:
        """Replace every sharded parameter by its whole tensor (a collective: every rank calls
        it), e.g. to write the trained model; the engine cannot run the model afterwards."""
        from torch.distributed.tensor import DTensor

        new: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if isinstance(p, DTensor):
                    if id(p) not in new:
                        new[id(p)] = nn.Parameter(p.full_tensor().detach(), requires_grad=p.requires_grad)
                    module._parameters[name] = new[id(p)]

    @contextlib.contextmanager
    def whole_parameters(self, model: nn.Module):
        """``model`` with every sharded parameter gathered whole for the duration (a
        collective: every rank enters it), e.g. to evaluate it eagerly; the shards, which the
        engine and the optimizer hold, are back on exit. Every rank holds the whole model
        meanwhile, as ``unshard_model`` leaves it."""
        from torch.distributed.tensor import DTensor

        whole = {name: p.full_tensor().detach() for name, p in model.named_parameters() if isinstance(p, DTensor)}
        with swapped_tensors(model, whole):
            yield model

    def _sharded(self, p: nn.Parameter, name: str) -> nn.Parameter:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(p, DTensor):
            if p.device_mesh != self.mesh or tuple(p.placements) != self.placements:
                raise ValueError(f"compile: parameter {name} is already a DTensor on {p.device_mesh} with "
                                 f"{p.placements}, not this engine's fsdp layout {self.placements} on {self.mesh}; "
                                 "compile a model with plain parameters")
            return p
        if p.dim() == 0:
            raise UnsupportedModelError(f"fsdp: parameter {name} is a scalar and cannot be sharded along dim 0; "
                                        "make it shape (1,) or freeze it")
        return nn.Parameter(distribute_tensor(p.detach(), self.mesh, self.placements), requires_grad=p.requires_grad)

    def rows(self, p: torch.Tensor) -> int:
        """Rows of every (padded) shard of ``p``: ceil(dim 0 / n)."""
        return math.ceil(p.shape[0] / self.n)

    def local(self, p: DTensor) -> torch.Tensor:
        """This rank's shard of ``p``, padded with zero rows to ``rows(p)``."""
        t = p.to_local()
        missing = self.rows(p) - t.shape[0]
        if missing:
            t = torch.cat([t, t.new_zeros((missing, *t.shape[1:]))])
        return t

    def to_param_grad(self, shard: torch.Tensor, p: DTensor) -> DTensor:
        """A padded gradient shard of ``p`` as a DTensor laid out like ``p``."""
        from torch.distributed.tensor import DTensor

        rows = p.to_local().shape[0]
        return DTensor.from_local(shard[:rows].to(p.dtype).contiguous(), self.mesh, self.placements,
                                  run_check=False, shape=p.shape, stride=p.stride())

    @contextlib.contextmanager
    def full_parameters(self, model: nn.Module, dtype: torch.dtype | None):
        """``model`` with fake, full-shape parameters (in ``dtype``; floating buffers cast to
        it) in place of its shards, for capture: the trace needs global shapes, not values,
        and nothing is gathered."""
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        swapped = {}
        for name, p in model.named_parameters():  # a tied weight's other names follow it
            with mode:
                fake = torch.empty(p.shape, dtype=dtype if dtype is not None and p.is_floating_point() else p.dtype,
                                   device=p.device)
            swapped[name] = nn.Parameter(fake, requires_grad=p.requires_grad)
        if dtype is not None:
            for name, b in model.named_buffers():
                if b.is_floating_point():
                    swapped[name] = b.to(dtype)
        with swapped_tensors(model, swapped):
            yield model
