"""Checkpoints of a training run with ``torch.distributed.checkpoint`` (DCP): the model, the
optimizer and the engine's state, so a run saved on N ranks resumes on M ranks.

Sharded parameters and optimizer states (``compile(..., fsdp=...)``) are saved as the
DTensors they are, each rank writing its own shards; DCP re-shards them for the mesh of
the run that loads them (``torch.distributed.checkpoint.state_dict`` gives and takes the
model's and the optimizer's state in that form). Unsharded models are saved the same way.
The engine's state (the accountant, and the sampler's if given) is one object, identical on
every rank, written once. The noise key is not in it: a loaded engine draws fresh noise
(``Engine.load_state_dict``).

SECRET: the sampler's state holds the sampling key. Store checkpoints like the private data.
"""
from __future__ import annotations

import contextlib
import io
import warnings

import torch

# torch.distributed.checkpoint (and DTensor under it) is imported in save and load, not with
# this module: 0.7 s of every process's start, for runs that never write a DCP checkpoint.


def save(path, engine, optimizer, sampler=None, *, run_dir) -> None:
    """Write ``engine``'s model, ``optimizer`` and engine state (and ``sampler``'s) to the
    folder ``path``; every rank of the run calls it. Save between ``finalize`` and the next
    ``accumulate``. First the steps taken since the last save go into the run ledger of
    ``run_dir``, the run's folder (``run_core.RunLedger``), fsync'd, by rank 0. It has no default:
    a folder guessed from ``path`` would give each checkpoint of a one-folder-per-checkpoint
    layout a ledger of its own, which an older checkpoint would pass. ``run_dir=None``: the
    caller keeps the ledger itself (the CLI records once the checkpoint is whole)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ..run_core import RunLedger

    if run_dir is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        RunLedger(run_dir).record(engine, sampler, "checkpoint")
    model_state, optimizer_state = get_state_dict(engine.model, optimizer)
    blob = io.BytesIO()
    torch.save(engine.state_dict(sampler), blob)
    with _one_process_is_meant():
        dcp.save({"model": model_state, "optimizer": optimizer_state, "engine": blob.getvalue()},
                 checkpoint_id=str(path))


def load(path, engine, optimizer, sampler=None, *, run_dir, fork: bool = False) -> None:
    """Restore what ``save`` wrote into ``engine``'s model, ``optimizer`` and the engine (and
    ``sampler``), whatever the mesh and sharding of the run that saved it. Every rank calls
    it, after ``compile`` and after building the optimizer over ``engine.model``'s parameters.

    A checkpoint older than the newest step in the run ledger of ``run_dir`` (the run's folder,
    as given to ``save``) is refused, before anything is changed, unless ``fork=True``: the
    fork's ε then covers every step in the ledger (``run_core.RunLedger``). ``run_dir`` cannot be
    None here: a load nothing checks could train again, unseen, steps already released."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ..run_core import RunLedger

    if run_dir is None:
        raise ValueError(f"load_checkpoint({path}): run_dir=None; pass the run's folder (the run_dir given to "
                         "save_checkpoint): its ledger is what a load is checked against, so that a state older than "
                         "the steps already released is refused (or forked, fork=True) rather than trained again unseen")

    engine_only = {"engine": b""}  # first: a refused state must leave the model as it was (DCP loads in place)
    with _one_process_is_meant():
        dcp.load(engine_only, checkpoint_id=str(path))
    engine_state = torch.load(io.BytesIO(engine_only["engine"]), weights_only=True)
    elsewhere = RunLedger(run_dir).admit(
        engine_state, fork=fork, fork_hint="pass fork=True", where=f"load_checkpoint({path})")
    model_state, optimizer_state = get_state_dict(engine.model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    with _one_process_is_meant():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(engine.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    engine.load_state_dict(engine_state, sampler, fork=fork, released_elsewhere=elsewhere)


@contextlib.contextmanager
def _one_process_is_meant():
    """Without torch.distributed, DCP warns that it assumes one process: that is this run's layout."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
