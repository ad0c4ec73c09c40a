"""Traces shared across engines: one trace per model structure per process.

Tracing (dynamo, then aot-autograd's joint export) is most of what compiling costs, and its
result depends on how the model is built, not on which instance or which tensor values:
parameters, buffers and the batch are graph inputs. So an engine first asks this cache for a
trace of a model like its own, traced the same way (``Engine._lower``): a second engine of a
model (another config, mesh or pass list) and an engine of a rebuilt model of the same
structure trace nothing.

"Like its own" is ``trace_key``: the capture's setting (the traced module's type, compute
dtype, sharded or not, the shard of the batch's shapes), every module's name and type, the
functions of its class (a method replaced on a class, which dynamo's guards miss, makes another
key) and those set on the instance, each parameter's and buffer's strides, and the model's
fingerprint (``runtime.guards``) with tensor identities replaced by first-appearance indices,
so tied weights must be tied alike. The key holds those functions, so none is freed and its
id reused while the trace is kept. On a hit, dynamo's guards of the trace are checked on the
model at hand (whatever else the trace read). Not kept, so traced anew each time: a graph
holding a tensor constant (a ``get_attr``: a plain tensor attribute, baked in, which may be
reassigned), a model with module hooks (their dicts are in neither key nor guards), and
fake-parameter models (the planner's: large, made once). The warnings the trace gave (a
parameter the loss never reaches) are given again on every reuse.
"""
from __future__ import annotations

import collections
import functools
import types
import warnings

from torch import nn

from .._torch import GUARDS, FakeTensor, has_module_hooks
from ..capture import CapturedGraph

_LIMIT = 8  # traces kept, least recently used dropped
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)
# trace_key -> (the trace, unrewritten; the warnings tracing gave)
_TRACES: collections.OrderedDict = collections.OrderedDict()


def trace_key(model: nn.Module, state: dict, traced: tuple) -> tuple:
    """The key of ``model``'s trace: ``traced`` (how it is traced), module names and types, the
    functions of their classes and those set on instances, tensor strides, and ``state`` (its
    fingerprint) without tensor identities."""
    first: dict[int, int] = {}
    canonical = []
    for name, value in state.items():
        if name.startswith(("parameter ", "buffer ")):
            value = (first.setdefault(value[0], len(first)), *value[1:])
        canonical.append((name, value))
    code: dict[type, tuple] = {}
    modules = []
    for name, m in model.named_modules(remove_duplicate=False):
        if type(m) not in code:
            code[type(m)] = _functions(type(m))
        modules.append((name, type(m), tuple((k, v) for k, v in vars(m).items() if isinstance(v, _FUNCTIONS))))
    strides = tuple(t.stride() for t in (*model.parameters(), *model.buffers()))
    return traced, tuple(modules), tuple(code.items()), strides, tuple(canonical)


def _functions(cls: type) -> tuple:
    """The functions of ``cls`` and its bases (a method replaced on a class makes another key)."""
    return tuple((name, v) for klass in cls.__mro__ if klass is not object
                 for name, v in vars(klass).items() if isinstance(v, _FUNCTIONS))


def shared_trace(key: tuple, model: nn.Module, guard_failure) -> CapturedGraph | None:
    """A copy of the kept trace under ``key`` if it serves ``model``, else None.
    ``guard_failure(guards)``: the first of dynamo's guards that fails on ``model``, or None."""
    entry = _TRACES.get(key)
    if entry is None or has_module_hooks(model):
        return None
    captured, caught = entry
    guards = captured.gm.meta.get(GUARDS)
    if guards is not None and guard_failure(guards) is not None:
        return None
    _TRACES.move_to_end(key)
    _warn_again(caught)
    return captured.copy()


def trace(fn, *args) -> tuple:
    """``fn(*args)`` (a capture) and the warnings it gave, which are given here too."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        captured = fn(*args)
    _warn_again(caught)
    return captured, caught


def _warn_again(caught: list) -> None:
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def keep_trace(key: tuple, model: nn.Module, captured: CapturedGraph, caught: list) -> None:
    """Keep ``captured`` (unrewritten: call before any pass) and the warnings ``caught`` while
    tracing it as the trace under ``key``, unless it is of a kind that is traced anew each time."""
    if (any(n.op == "get_attr" for n in captured.gm.graph.nodes) or has_module_hooks(model)
            or any(isinstance(p, FakeTensor) for p in model.parameters())):
        return
    _TRACES[key] = (captured.copy(), list(caught))
    _TRACES.move_to_end(key)
    while len(_TRACES) > _LIMIT:
        _TRACES.popitem(last=False)
