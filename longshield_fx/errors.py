"""Errors raised by longshield_fx. Each message names the problem and the way out."""


class UnsupportedModelError(RuntimeError):
    """The model does something per-sample DP cannot handle exactly.

    Raised when an op mixes samples (batch norm, in-batch pairs, a reduction over the
    batch dimension) or when a trainable parameter's gradient comes from a pattern no
    per-sample rule knows. We never fall back to an approximation: a silently wrong
    per-sample gradient is a silently wrong privacy guarantee.
    """


class DataError(ValueError):
    """The user's documents cannot be loaded as asked (a missing or unreadable path, a bad
    line, nothing usable): the message names the file (and line) and what is accepted."""
