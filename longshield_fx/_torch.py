"""The private torch APIs longshield_fx uses, all behind this one adapter (checked on torch 2.13).

A torch upgrade that breaks one of them breaks it here; nothing else in the package imports
a ``torch._*`` module or ``torch.testing._internal``.

=================================================================  ======================================
private API                                                        why
=================================================================  ======================================
``torch._dynamo.functional_export.dynamo_graph_capture_for_export``  capture with module metadata kept
``torch._dynamo.convert_frame.get_traced_fn``, ``._get_frame``       dynamo's guards of a capture (its
``torch._dynamo.hooks.Hooks``, ``torch._dynamo.utils`` metrics       ``CaptureOutput``): built once,
``torch._export.utils._compiling_state_context``                     checked before each run (DynamoGuards)
``torch._functorch.aot_autograd.aot_export_joint_with_descriptors``  the joint forward+backward graph
``torch._functorch._aot_autograd.descriptors``                       which graph input/output is what
``torch._dynamo.config.patch``, ``torch._guards.tracing``            static shapes; the tracing context
``torch._dynamo.config`` ``allow_rnn``, ``torch._C._set_mkldnn_enabled``  nn.RNN/GRU/LSTM traced and decomposed
``torch._dynamo.variables.tensor.TensorVariable.var_getattr``        a buffer's ``persistent`` flag readable
                                                                   during capture (``_buffer_flags_readable``)
``torch._dynamo.variables.functions.SkipFunctionVariable``           pack/pad_packed_sequence traced as fixed-
``torch._dynamo.variables.UserFunctionVariable``                     shape stand-ins (``_packing_traced``)
``torch._subclasses.fake_tensor.FakeTensorMode``, ``FakeTensor``     fake models (planner, tests); the packed
                                                                   isolation probe skips fake batches
``torch._ops.OpOverload``                                            "is this an aten overload with tags"
``torch.fx._lazy_graph_module``                                     graph code generated once, when run or
                                                                   read, not at each pass's recompile
``torch.ops._c10d_functional``                                       functional collectives in graphs
``torch.testing._internal.distributed.fake_pg``                      registers the "fake" process group
``torch.distributed.distributed_c10d._resolve_process_group``        a graph's group name -> its group
``torch.nn.utils.stateless._reparametrize_module``                   capture a sharded model with fake
                                                                   full-shape parameters
``DeviceMesh._flatten``, slicing a root mesh by a flattened dim     one group over several mesh dims;
                                                                   the (replicate, shard) mesh of FSDP
``torch.distributed.tensor._op_schema``, ``._dtensor_spec``,          how an op without a hand batch rule
``DTensor._op_dispatcher.sharding_propagator``                       carries the batch (batch_dims)
``torch._grouped_mm``                                                per-unit linear gradients of packed
                                                                   documents on CUDA (ops/segment.py)
``ProcessGroupGloo._Options`` ``_threads``/``_devices``, a group's    gloo with one worker thread
``_get_backend``                                                     (``serial_gloo``)
``torch.nn.modules.module._global_*hooks``, a module's ``_*hooks``    hooked models keep their own
                                                                   traces (``runtime.traces``)
``DeviceMesh._pg_registry``                                           a mesh's groups let go at the end
                                                                   (``destroy_process_groups``)
=================================================================  ======================================
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import unittest.mock
import warnings

import torch
import torch.distributed as dist
# Imported with this package, before any default process group exists: its functions take
# ``group=group.WORLD`` as a default argument, so imported later (DCP imports it, at our first
# checkpoint) they hold the default group for good, past destroy_process_group (see
# destroy_process_groups). 7 ms.
import torch.distributed.nn.functional  # noqa: F401
import torch.fx as fx
from torch._functorch._aot_autograd import descriptors  # noqa: F401  (re-exported)
from torch._ops import OpOverload  # noqa: F401  (re-exported)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: F401  (re-exported)

__all__ = ["BatchArg", "COLLECTIVES", "GUARDS", "DynamoGuards", "FakeTensor", "FakeTensorMode", "OpOverload", "c10d", "descriptors",
           "destroy_process_groups", "dtensor_batch_dims", "export_joint", "fake_world", "flattened_group", "graph_module", "sharding_mesh",
           "swapped_tensors", "resolve_process_group"]

c10d = torch.ops._c10d_functional
COLLECTIVES = {c10d.reduce_scatter_tensor.default, c10d.all_reduce.default, c10d.all_gather_into_tensor.default,
               c10d.all_to_all_single.default}


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The process group a functional collective or custom op names by ``group_name``."""
    return dist.distributed_c10d._resolve_process_group(group_name)


GUARDS = "dynamo_guards"  # the ``meta`` key of ``export_joint``'s graph that holds its ``DynamoGuards``


class CaptureError(Exception):
    """Dynamo could not trace the model's forward into one graph (a graph break, a
    data-dependent shape, an unsupported Python construct)."""


def graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)`` whose Python code is generated when it is first run or its
    code read, not at every ``recompile()``: a lowering rewrites and recompiles a graph once per
    pass, and only the last graph's code is ever used (the planner's never is)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)


def export_joint(model: torch.nn.Module, example_batch: tuple) -> tuple[fx.GraphModule, object]:
    """The aot-autograd joint graph of ``model(*example_batch)`` and its fake mode.

    Dynamo keeps ``nn_module_stack`` (forward) / ``fwd_nn_module_stack`` (backward) on nodes.
    Shapes are static: a second capture of the same code with another batch size would
    otherwise turn sizes symbolic (dynamo's automatic dynamic shapes). Dynamo's guards of
    this capture are on ``graph.meta[GUARDS]`` (a ``DynamoGuards``).
    """
    from torch._dynamo.functional_export import dynamo_graph_capture_for_export
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    import torch.fx.traceback as fx_traceback
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    # ``allow_rnn``: dynamo refuses nn.RNN/GRU/LSTM by default; traced, they are aten's RNN ops,
    # which aot-autograd decomposes into per-step matmuls and pointwise ops (the CPU's oneDNN
    # LSTM kernel, ``mkldnn_rnn_layer``, is switched off so the LSTM decomposes too).
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, assume_static_by_default=True,
                                    allow_rnn=True), \
            _without_onednn(), _use_lazy_graph_module(True), \
            fx_traceback.preserve_node_meta(), _buffer_flags_readable(), _packing_traced():
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                dynamo_gm = dynamo_graph_capture_for_export(model)(*example_batch)
        except torch._dynamo.exc.TorchDynamoException as e:
            raise CaptureError(_graph_break(e)) from e
        for w in caught:
            if not _only_output_collector(str(w.message)):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    guards = DynamoGuards.build(dynamo_gm, model)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._guards.tracing(dynamo_gm.meta["tracing_context"]))
        stack.enter_context(_without_onednn())
        stack.enter_context(_use_lazy_graph_module(True))
        joint = aot_export_joint_with_descriptors(stack, dynamo_gm, tuple(example_batch))
    joint.graph_module.meta[GUARDS] = guards
    return joint.graph_module, joint.fake_mode


def _graph_break(e: Exception) -> str:
    """What broke dynamo's trace, in one line: its kind, the function or op it names (its
    "Explanation"), and the user's line that called it ("from user code"). The first line of
    dynamo's message alone names nothing ("Attempted to call function marked as skipped")."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    lines = text.splitlines()
    parts = [lines[0].strip()]
    explanation = next((ln.strip().removeprefix("Explanation:").strip().rstrip(".") for ln in lines
                        if ln.strip().startswith("Explanation:")), None)
    if explanation:
        parts.append(explanation)
    frame = (getattr(e, "real_stack", None) or [None])[-1]
    if frame is not None:
        where = f"at {frame.filename}:{frame.lineno}, in {frame.name}"
        parts.append(f"{where}: `{frame.line.strip()}`" if frame.line else where)
    return "; ".join(parts)


def _only_output_collector(message: str) -> bool:
    """Dynamo's "side effects happened in the model.forward" warning naming only transformers'
    output collector, a module global every HF forward sets and restores (``output_capturing``):
    nothing the graph drops. Any other side effect it lists is still warned about."""
    if "side effects happened" not in message or "[" not in message:
        return False
    sources = [src.strip(" '\"") for src in message[message.index("[") + 1:message.rindex("]")].split(",")]
    return bool(sources) and all(src.endswith("output_capturing']._active_collector") for src in sources)


@contextlib.contextmanager
def _without_onednn():
    """oneDNN off while tracing (``torch.backends.mkldnn.flags`` would also set its TF32 flag,
    which warns on every CPU build)."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


@contextlib.contextmanager
def _buffer_flags_readable():
    """Dynamo (torch 2.13) types a tensor whose fake value is a module buffer as ``nn.Buffer``
    but cannot read the buffer's ``persistent`` flag, which fake tensors do carry. A forward
    that assigns a buffer to itself (``self.pe = self.pe.to(dtype)``, a no-op ``to``: CTRL)
    runs ``Module.__setattr__``, which reads ``value.persistent`` of an ``nn.Buffer``, and
    breaks the graph. The flag is a Python bool fixed at the buffer's creation, the very value
    eager reads; it only decides ``state_dict`` membership, never the graph's values."""
    from torch._dynamo.variables import ConstantVariable
    from torch._dynamo.variables.tensor import TensorVariable

    original = TensorVariable.var_getattr

    def var_getattr(self, tx, name):
        if name == "persistent" and self.class_type is torch.nn.Buffer:
            flag = getattr(self.proxy.node.meta.get("example_value"), "persistent", None)
            if isinstance(flag, bool):
                return ConstantVariable.create(flag)
        return original(self, tx, name)

    TensorVariable.var_getattr = var_getattr
    try:
        yield
    finally:
        TensorVariable.var_getattr = original


@contextlib.contextmanager
def _packing_traced():
    """Dynamo skips ``torch.nn.utils.rnn.pack_padded_sequence`` and ``pad_packed_sequence``
    (``SkipFunctionVariable``: a graph break, which a capture cannot take). While capturing they
    are traced as their fixed-shape stand-ins in ``_packed_rnn`` (the padded batch and each
    sample's length), whichever name the forward calls them by."""
    from torch._dynamo.variables import UserFunctionVariable
    from torch._dynamo.variables.functions import SkipFunctionVariable
    from torch.nn.utils import rnn

    from . import _packed_rnn

    stand_ins = {rnn.pack_padded_sequence: _packed_rnn.pack_padded_sequence,
                 rnn.pad_packed_sequence: _packed_rnn.pad_packed_sequence}
    original = SkipFunctionVariable.call_function

    def call_function(self, tx, args, kwargs):
        stand_in = stand_ins.get(self.value)
        if stand_in is not None:
            return UserFunctionVariable(stand_in).call_function(tx, args, kwargs)
        return original(self, tx, args, kwargs)

    SkipFunctionVariable.call_function = call_function
    try:
        yield
    finally:
        SkipFunctionVariable.call_function = original


class DynamoGuards:
    """What dynamo's trace of a capture assumed beyond tensor values: the attributes, config
    values, globals and closures the forward read, grad mode and other global torch state,
    and the batch tensors' metadata. ``failure(model, batch)`` says whether the same capture
    would still trace the same graph, in microseconds (dynamo's C++ guard manager).

    Guards on the model's parameters and buffers are left out: the capture may run on a
    cast copy of the model (``compute_dtype``), whose dtypes the live model never has, and
    the engine checks the live parameters itself.
    """

    def __init__(self, manager):
        self._manager = manager

    @classmethod
    def build(cls, dynamo_gm: fx.GraphModule, model: torch.nn.Module) -> "DynamoGuards":
        from torch._dynamo.convert_frame import get_traced_fn
        from torch._dynamo.hooks import Hooks
        from torch._dynamo.utils import dynamo_timed, get_metrics_context
        from torch._export.utils import _compiling_state_context

        state = {id(t) for t in (*model.parameters(), *model.buffers())}

        def keep(entries):
            return [not (e.guard_type == "TENSOR_MATCH" and e.has_value and id(e.value) in state) for e in entries]

        # dynamo_graph_capture_for_export builds no guards; its CaptureOutput rides on the graph.
        out = dynamo_gm._dynamo_bytecode_flatten.out
        with _compiling_state_context(), get_metrics_context(), dynamo_timed("longshield_build_guards"), \
                _guard_latency_unmeasured():
            manager = out.graph_capture_output.build_guards(get_traced_fn(model)[0].__code__,
                                                            hooks=Hooks(guard_filter_fn=keep))
        return cls(manager.guard_manager)

    def failure(self, model: torch.nn.Module, batch: tuple) -> str | None:
        """None if every guard holds for ``model(*batch)``, else the first failing guard in words."""
        from torch._dynamo.convert_frame import _get_frame

        f_locals = _get_frame(model, tuple(batch)).locals
        if self._manager.check(f_locals):
            return None
        parts = self._manager.check_verbose(f_locals).verbose_code_parts
        return parts[0] if parts else "a dynamo guard failed"


def _guard_latency_unmeasured():
    """Building guards, dynamo (torch 2.13) times one run of them after flushing the CPU caches,
    for a compile metric nobody reads here: 28 ms of each capture's CPU, most of building the
    guards of a small model. The guards are still built and checked on the frame they came from."""
    import torch._dynamo.guards as dynamo_guards

    return unittest.mock.patch.object(dynamo_guards, "profile_guard_manager", lambda *args: 0.0)


@contextlib.contextmanager
def fake_world(cp: int, dp: int = 1, hp: int = 1, rank: int = 0):
    """A one-process fake process group of ``dp * cp * hp`` ranks; yields its mesh with dims
    ("dp", "cp", "hp"), leaving out "dp" and "hp" where they are 1 (1-D "cp" for plain
    context parallelism). ``rank``'s view (default rank 0): graphs get real shapes and
    collective nodes, nothing is sent. The group is destroyed on exit."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.distributed.device_mesh import init_device_mesh

    dims = [(name, size) for name, size in (("dp", dp), ("cp", cp), ("hp", hp)) if size > 1 or name == "cp"]
    dist.init_process_group("fake", rank=rank, world_size=dp * cp * hp, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
    finally:
        dist.destroy_process_group()


def destroy_process_groups(peers_finished: bool) -> None:
    """``dist.destroy_process_group()``, and the groups really gone when it returns.

    c10d's destroy drops c10d's own references only. A DeviceMesh keeps its groups
    (``DeviceMesh._pg_registry``, torch 2.13), and a mesh lives as long as anything holds it:
    the engine, DTensor parameters, DTensor's sharding caches. A gloo group kept alive runs its
    worker and transport threads on into interpreter finalization, where a worker thread that
    lets go of a tensor takes the GIL of an interpreter being torn down and can abort the process
    ("terminate called without an active exception", as one rank of a finished CLI run did; the
    closed pull request pytorch/pytorch#179291 describes that abort for groups never destroyed).
    So every live mesh forgets its groups here: the last references go, and each group's threads
    are joined while the interpreter is whole.

    ``peers_finished``: every rank got here after the same collectives (the run ended normally). A
    barrier then lets each rank's last collectives finish, so joining the worker threads cannot
    wait on a transfer. Otherwise (an error, a peer may be gone) the groups are only destroyed:
    joining a worker blocked on a dead peer would hold this rank's error back for the timeout."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        return
    if peers_finished:
        try:
            dist.barrier()
        except RuntimeError:  # a peer is gone after all
            peers_finished = False
    dist.destroy_process_group()
    if peers_finished:
        gc.collect()  # the run's objects in reference cycles, groups among them, go now, not at exit
        for obj in gc.get_objects():
            if isinstance(obj, DeviceMesh):
                obj._pg_registry.clear()


def in_fake_world() -> bool:
    """Whether the default process group is ``fake_world``'s (nothing is sent or received)."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def has_module_hooks(model: torch.nn.Module) -> bool:
    """Whether a user's forward or backward hook would run around a module of ``model``: one of
    its own, or one set for every module. Only reads the hook dicts; nothing is registered."""
    import torch.nn.modules.module as m

    kinds = ("forward_hooks", "forward_pre_hooks", "backward_hooks", "backward_pre_hooks")
    return (any(getattr(m, f"_global_{kind}") for kind in kinds)
            or any(getattr(module, f"_{kind}") for module in model.modules() for kind in kinds))


def swapped_tensors(model: torch.nn.Module, tensors: dict):
    """``model`` with parameters/buffers named in ``tensors`` swapped in for the duration (a
    tied weight's other names follow it), as ``torch.func.functional_call`` does."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(model, tensors, tie_weights=True)


def sharding_mesh(mesh, replicate: tuple[str, ...], shard: tuple[str, ...]):
    """(mesh, position of the shard dim in it) for sharded model states: 1-D over ``shard``
    (the dims flattened into one), or 2-D with ``replicate`` flattened, for hybrid sharding as
    FSDP2's HSDP; the two in the order their dims have in ``mesh`` (torch slices a mesh only
    in its own dim order). Raises ValueError when the groups interleave in the mesh."""
    def flat(dims):
        return mesh[dims[0]] if len(dims) == 1 else mesh[dims]._flatten()

    shard_mesh = flat(shard)
    if not replicate:
        return shard_mesh, 0
    names = list(mesh.mesh_dim_names)
    shard_first = names.index(shard[0]) < names.index(replicate[0])
    groups = (shard_mesh, flat(replicate)) if shard_first else (flat(replicate), shard_mesh)
    try:
        with warnings.catch_warnings():  # torch 2.13 warns that slicing a flattened dim will be deprecated
            warnings.simplefilter("ignore", UserWarning)
            return mesh[tuple(g.mesh_dim_names[0] for g in groups)], 0 if shard_first else 1
    except (KeyError, RuntimeError, ValueError) as e:
        raise ValueError(f"the sharded dims {shard} and the replicated dims {replicate} interleave in the mesh "
                         f"{tuple(names)} ({e})") from e


def flattened_group(mesh, dims: tuple[str, ...]) -> dist.ProcessGroup:
    """One process group over the mesh dims ``dims`` (in the mesh's order), e.g. every rank
    that holds part of one sequence: ("cp", "hp"). A rank's index in it is row-major over
    those dims."""
    if len(dims) == 1:
        return mesh[dims[0]].get_group()
    return mesh[dims]._flatten().get_group()


# --- gloo with one worker thread ------------------------------------------------------------------

SERIAL_GLOO = "longshield_gloo"


def serial_gloo() -> str:
    """The name of a gloo backend whose process groups run their asynchronous collectives on
    ONE worker thread (registered on the first call): ``dist.init_process_group(serial_gloo())``
    makes it the default, so the groups made after it (DeviceMesh's too) use it as well.

    Why: torch's ProcessGroupGloo runs them on two worker threads, and each thread writes the
    name of the collective it finished into the group's shared status
    (``ProcessGroupGloo::runLoop``: ``pgStatus_->lastCompletedWorkName``) outside any lock. Two
    collectives finishing together race on that std::string: a double free (AddressSanitizer
    shows it) that aborts a rank with glibc's "malloc(): unaligned tcache chunk detected" or
    corrupts its heap silently. The overlap pass keeps several collectives in flight, which is
    where training under gloo met it (``benchmarks/stress_gloo_race.py``)."""
    if not hasattr(dist.Backend, SERIAL_GLOO.upper()):
        dist.Backend.register_backend(SERIAL_GLOO, _serial_gloo_group, devices=["cpu"])
    return SERIAL_GLOO


def _serial_gloo_group(store, rank: int, size: int, timeout) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    options._threads = 1
    return dist.ProcessGroupGloo(store, rank, size, options)


def gloo_worker_threads(group: dist.ProcessGroup) -> int:
    """How many threads run ``group``'s asynchronous gloo collectives; 0 when it is not gloo."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:  # no CPU backend (NCCL only)
        return 0
    return backend.options._threads if isinstance(backend, dist.ProcessGroupGloo) else 0


# --- DTensor's sharding propagation, asked how an op carries the batch dimension ------------------

@dataclasses.dataclass(frozen=True)
class BatchArg:
    """A tensor argument for ``dtensor_batch_dims``: its (fake) value and its batch dim or None."""

    value: torch.Tensor
    dim: int | None


@functools.lru_cache(maxsize=None)
def _batch_mesh(rows: int):
    from torch.distributed.device_mesh import DeviceMesh
    # One mesh coordinate per sample; no process group is created or needed.
    return DeviceMesh("cpu", torch.arange(rows), _init_backend=False, _rank=0)


def dtensor_batch_dims(op, args, kwargs, B: int):
    """How DTensor's sharding rules carry the batch: every ``BatchArg`` with a dim is sharded
    along it over a mesh of B coordinates, the others replicated. Returns, per output, None
    (not a tensor), ``("shard", dim)``, ``("partial",)`` or ``("replicate",)`` as a tuple
    (a single entry for a single output); ``"redistribute"`` when DTensor would first move a
    sharded input's data between coordinates (cutting a replicated input into shards is local
    and allowed); None when DTensor has no rule for the op."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema

    mesh = _batch_mesh(B)

    def spec(x):
        if not isinstance(x, BatchArg):
            return x
        placement = Replicate() if x.dim is None else Shard(x.dim)
        return DTensorSpec(mesh, (placement,), TensorMeta(x.value.shape, x.value.stride(), x.value.dtype))

    is_arg = lambda x: isinstance(x, BatchArg)  # noqa: E731
    schema_args = torch.utils._pytree.tree_map(spec, args, is_leaf=is_arg)
    schema_kwargs = torch.utils._pytree.tree_map(spec, kwargs, is_leaf=is_arg)
    schema = OpSchema(op, tuple(schema_args), schema_kwargs)
    try:
        # Not the cached entry point: its key leaves out non-tensor arguments (a dim) unless the
        # op's registration lists them, so logcumsumexp over dim 1 would answer for dim 0.
        out = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached(schema)
    except Exception:  # DTensor has no strategy for this op or these arguments
        return None
    if out.needs_redistribute:
        # Slicing a replicated input into shards is local; moving a sharded one is not.
        for before, after in zip(schema.args_spec, out.redistribute_schema.args_spec):
            if before.placements != after.placements and not (
                    before.placements[0].is_replicate() and after.placements[0].is_shard()):
                return "redistribute"

    def placement(s):
        if not isinstance(s, DTensorSpec):
            return None
        p = s.placements[0]
        return ("shard", p.dim) if p.is_shard() else ("partial",) if p.is_partial() else ("replicate",)

    specs = out.output_spec
    return tuple(placement(s) for s in (specs if isinstance(specs, (tuple, list)) else (specs,)))


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(G, p, d): ``a[:, rows of g] @ b[rows of g]`` for the row groups ending at ``offsets`` (int32)."""
    return torch._grouped_mm(a, b, offs=offsets)
