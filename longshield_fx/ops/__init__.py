"""Custom ops that rewritten graphs call: importing this package registers them.

Both the passes (which put these ops into graphs) and the runtime (which runs the
graphs) import from here, so neither layer imports the other for an op.
"""
from . import lm_head_loss  # noqa: F401  (registers longshield::lm_head_loss)
from . import ring_attention  # noqa: F401  (registers longshield::ring_attention and its backward)
from . import segment  # noqa: F401  (registers longshield::segment_outer)
