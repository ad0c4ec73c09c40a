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
key) and those set on the instance, and the model's fingerprint (``runtime.guards``) with tensor
identities replaced by first-appearance indices, so tied weights must be tied alike. On a
hit, dynamo's guards of the trace are checked on the model at hand (whatever else the trace
read). A graph holding a tensor constant (a ``get_attr``: a plain tensor attribute, baked in)
serves only the model it was traced from. The warnings the trace gave (a parameter the loss
never reaches) are given again on every reuse. Traces of fake-parameter models (the
planner's) are not kept: they are large and made once.
"""
from __future__ import annotations

import collections
import functools
import types
import warnings
import weakref

from torch import nn

from .._torch import GUARDS, FakeTensor
from ..capture import CapturedGraph

_LIMIT = 8  # traces kept, least recently used dropped
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)
# trace_key -> (the model traced, whether the graph holds tensor constants, the trace, unrewritten,
# the warnings tracing gave)
_TRACES: collections.OrderedDict = collections.OrderedDict()


def trace_key(model: nn.Module, state: dict, traced: tuple) -> tuple:
    """The key of ``model``'s trace: ``traced`` (how it is traced), module names and types, the
    ids of the functions of their classes and of those set on instances, and ``state`` (its
    fingerprint) without tensor identities."""
    first: dict[int, int] = {}
    canonical = []
    for name, value in state.items():
        if name.startswith(("parameter ", "buffer ")):
            value = (first.setdefault(value[0], len(first)), *value[1:])
        canonical.append((name, value))
    code: dict[type, tuple] = {}
    for m in model.modules():
        if type(m) not in code:
            code[type(m)] = _functions(type(m))
    modules = tuple((name, type(m), tuple((k, id(v)) for k, v in vars(m).items() if isinstance(v, _FUNCTIONS)))
                    for name, m in model.named_modules(remove_duplicate=False))
    return traced, modules, tuple(code.items()), tuple(canonical)


def _functions(cls: type) -> tuple:
    """The ids of the functions of ``cls`` and its bases: a method replaced on a class (which
    dynamo's guards do not see) makes another key."""
    return tuple((name, id(v)) for klass in cls.__mro__ if klass is not object
                 for name, v in vars(klass).items() if isinstance(v, _FUNCTIONS))


def shared_trace(key: tuple, model: nn.Module, guard_failure) -> CapturedGraph | None:
    """A copy of the kept trace under ``key`` that serves ``model``, or None.
    ``guard_failure(guards)``: the first of dynamo's guards that fails on ``model``, or None."""
    entry = _TRACES.get(key)
    if entry is None:
        return None
    traced_from, constants, captured, caught = entry
    if constants and traced_from() is not model:
        return None
    guards = captured.gm.meta.get(GUARDS)
    if guards is not None and guard_failure(guards) is not None:
        return None
    _TRACES.move_to_end(key)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return captured.copy()


def trace(fn, *args) -> tuple:
    """``fn(*args)`` (a capture) and the warnings it gave, which are given here too."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        captured = fn(*args)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return captured, caught


def keep_trace(key: tuple, model: nn.Module, captured: CapturedGraph, caught: list) -> None:
    """Keep ``captured`` (unrewritten: call before any pass) and the warnings ``caught`` while
    tracing it as the trace under ``key``."""
    if any(isinstance(p, FakeTensor) for p in model.parameters()):
        return
    constants = any(n.op == "get_attr" for n in captured.gm.graph.nodes)
    _TRACES[key] = (weakref.ref(model), constants, captured.copy(), list(caught))
    _TRACES.move_to_end(key)
    while len(_TRACES) > _LIMIT:
        _TRACES.popitem(last=False)
