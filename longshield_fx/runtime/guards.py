"""Capture guards: what a captured graph read beyond tensor values, as a fingerprint of the
model that the engine compares before each run (see ``Engine``). Dynamo's own guards of the
capture (``_torch.DynamoGuards``) cover what the trace read elsewhere."""
from __future__ import annotations

import torch
from torch import nn

# Exact types: isinstance would also ask a proxy for its __class__ (slow on HF configs).
_PLAIN = {int, float, bool, str, type(None), torch.dtype, torch.device}
_CONFIGS = ("config", "cfg")  # Hugging Face models read self.config.*, longshield_fx.models self.cfg.*
_TENSOR_FIELDS = ("identity", "shape", "dtype", "device", "requires_grad")


def _plain(value) -> bool:
    return type(value) in _PLAIN or (type(value) is tuple and all(type(v) in _PLAIN for v in value))


def _attributes(state: dict, prefix: str, attributes: dict) -> None:
    """The plain public ones of ``attributes`` (a ``vars()``) into ``state``, as ``prefix + name``.
    ``_``-names are torch's own (parameter, buffer, module and hook dicts) or private."""
    for name, value in attributes.items():
        if name[0] != "_" and _plain(value):
            state[prefix + name] = value


def fingerprint(model: nn.Module) -> dict:
    """What a capture of ``model`` may depend on beyond tensor values and dynamo's guards
    (see ``Engine``): name -> value, compared with ==. Cheap enough for every call (about
    0.3 ms for the tiny Llama): one walk over the modules, reading their ``__dict__``s."""
    state: dict = {}
    configs: set[int] = set()  # a config object is usually shared by many modules: read it once
    for name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        attributes = vars(module)
        _attributes(state, prefix, attributes)
        for attr in _CONFIGS:
            config = attributes.get(attr)
            if config is not None and id(config) not in configs and hasattr(config, "__dict__"):
                configs.add(id(config))
                _attributes(state, f"{prefix}{attr}.", vars(config))
        # What named_parameters/named_buffers(remove_duplicate=False) yield, in the same walk.
        for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers)):
            for key, t in tensors.items():
                if t is not None:
                    state[f"{kind} {prefix}{key}"] = (id(t), tuple(t.shape), t.dtype, t.device, t.requires_grad)
    return state


def describe_change(before: dict, now: dict, most: int = 3) -> str:
    """The differences between two fingerprints in words (the first ``most`` of them);
    ``model.train()``/``eval()`` flips are told as one."""
    missing = object()
    changed = [k for k in dict.fromkeys([*before, *now]) if before.get(k, missing) != now.get(k, missing)]
    flags = [k for k in changed if k.rpartition(".")[2] == "training" and k in before and k in now]
    words = []
    if len(flags) > 1:
        first = flags[0]
        words.append(f"the training flag of {len(flags)} modules ({first}: {before[first]} -> {now[first]}, ...)")
        changed = [k for k in changed if k not in flags]
    for key in changed:
        old, new = before.get(key, missing), now.get(key, missing)
        if old is missing or new is missing:
            words.append(f"{key} {'added' if old is missing else 'removed'}")
        elif key.startswith(("parameter ", "buffer ")):  # the first field that differs
            field, a, b = next((f, a, b) for f, a, b in zip(_TENSOR_FIELDS, old, new) if a != b)
            words.append(f"{key}: replaced by another tensor" if field == "identity" else f"{key}: {field} {a} -> {b}")
        else:
            words.append(f"{key}: {old!r} -> {new!r}")
    more = f" and {len(words) - most} more" if len(words) > most else ""
    return "; ".join(words[:most]) + more
