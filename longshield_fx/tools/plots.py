"""Pictures the command-line interface writes: the loss-vs-ε plot and a block's graph as SVG.

``loss_vs_epsilon`` needs matplotlib (a dependency; the Agg backend, no display).
``graph_svg`` draws an FX graph with graphviz's ``dot`` program when it is installed, and
otherwise with a small built-in layered layout, so it works on a fresh machine with nothing
extra installed. (torch.fx's ``FxGraphDrawer`` is not used: it needs pydot, and its record
labels break on einsum equations such as "btp,btd->bpd", which every per-sample graph has.)
"""
from __future__ import annotations

import html
import math
from pathlib import Path

from torch import fx


def loss_vs_epsilon(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Plot per-token training loss against the ε spent so far (one point per step), as PNG.

    ``rows`` are the metrics records (``epsilon``, ``loss``; steps with an empty Poisson
    batch have ``loss`` None and are skipped). A running mean over 5 steps is drawn on top.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    pts = [(r["epsilon"], r["loss"]) for r in rows if r.get("loss") is not None and math.isfinite(r["epsilon"])]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    if pts:
        eps, loss = zip(*pts)
        ax.plot(eps, loss, ".", color="tab:blue", alpha=0.45, label="step")
        k = 5
        if len(loss) >= k:
            smooth = [sum(loss[i - k + 1: i + 1]) / k for i in range(k - 1, len(loss))]
            ax.plot(eps[k - 1:], smooth, "-", color="tab:red", label=f"mean of {k} steps")
        ax.legend(loc="upper right")
    ax.set_xlabel("ε spent")
    ax.set_ylabel("training loss per token (nats)")
    ax.set_title(title or "loss vs privacy spent")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


# --- graph drawing ------------------------------------------------------------------------

def _kind(node: fx.Node) -> str:
    if node.op in ("placeholder", "get_attr", "output"):
        return "io"
    if node.meta.get("nn_module_stack"):
        return "forward"
    if node.meta.get("fwd_nn_module_stack"):
        return "backward"
    return "inserted"  # added by a pass (per-sample, clip, shard_grads, checkpoint)


_FILL = {"forward": "#cfe2ff", "backward": "#ffd8cc", "inserted": "#d3f4d3", "io": "#e6e6e6"}


def _label(node: fx.Node) -> str:
    if node.op == "call_function":
        target = str(node.target)
        for prefix in ("aten.", "_c10d_functional.", "longshield."):
            target = target.replace(prefix, "")
        target = target.removesuffix(".default")
        return f"{node.name}: {target}"
    return f"{node.name} ({node.op})"


def _shape(node: fx.Node) -> str:
    v = node.meta.get("val")
    shape = getattr(v, "shape", None)
    if shape is None:
        return ""
    dtype = str(getattr(v, "dtype", "")).replace("torch.", "")
    return f"{dtype}[{', '.join(str(s) for s in shape)}]"


def builtin_svg(graph: fx.Graph, title: str = "") -> str:
    """A layered drawing: each node one row below its deepest input, edges as straight arrows.

    Colours: forward nodes blue, backward red, nodes a pass inserted green, inputs and
    outputs grey. Not pretty for large graphs, but dependency-free and always readable.
    """
    nodes = list(graph.nodes)
    depth: dict[fx.Node, int] = {}
    for n in nodes:
        depth[n] = 1 + max((depth[a] for a in n.all_input_nodes if a in depth), default=-1)
    rows: dict[int, list[fx.Node]] = {}
    for n in nodes:
        rows.setdefault(depth[n], []).append(n)
    char_w, box_h, row_gap, col_gap, margin = 6.6, 34, 30, 14, 20
    pos: dict[fx.Node, tuple[float, float, float]] = {}  # x, y, width
    width = 0.0
    for d in sorted(rows):
        x = margin
        y = margin + 30 + d * (box_h + row_gap)
        for n in rows[d]:
            w = char_w * max(len(_label(n)), len(_shape(n))) + 16
            pos[n] = (x, y, w)
            x += w + col_gap
        width = max(width, x)
    height = margin * 2 + 30 + (max(rows) + 1 if rows else 0) * (box_h + row_gap)
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + margin:.0f}" height="{height:.0f}" '
           f'font-family="monospace" font-size="11">'),
           ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" '
           'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#555"/></marker></defs>'),
           f'<text x="{margin}" y="{margin + 8}" font-size="14">{html.escape(title)}</text>']
    for n in nodes:
        x1, y1, w1 = pos[n]
        for a in n.all_input_nodes:
            if a in pos:
                x0, y0, w0 = pos[a]
                out.append(f'<line x1="{x0 + w0 / 2:.1f}" y1="{y0 + box_h:.1f}" x2="{x1 + w1 / 2:.1f}" '
                           f'y2="{y1:.1f}" stroke="#555" stroke-width="0.8" marker-end="url(#arrow)"/>')
    for n in nodes:
        x, y, w = pos[n]
        out.append(f'<g><title>{html.escape(str(n.format_node()))}</title>'
                   f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{box_h}" rx="4" '
                   f'fill="{_FILL[_kind(n)]}" stroke="#333"/>'
                   f'<text x="{x + 8:.1f}" y="{y + 14:.1f}">{html.escape(_label(n))}</text>'
                   f'<text x="{x + 8:.1f}" y="{y + 27:.1f}" fill="#555">{html.escape(_shape(n))}</text></g>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def to_dot(graph: fx.Graph, title: str = "") -> str:
    """The graph in graphviz DOT, with the same labels and colours as ``builtin_svg``."""
    def esc(text: str) -> str:
        return text.replace("\\", "\\\\").replace('"', '\\"')

    ids = {n: f"n{i}" for i, n in enumerate(graph.nodes)}
    out = ["digraph G {", f'  label="{esc(title)}"; labelloc=t; rankdir=TB;',
           '  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];']
    for n in graph.nodes:
        label = esc(_label(n)) + (r"\n" + esc(_shape(n)) if _shape(n) else "")  # \n: dot's line break
        out.append(f'  {ids[n]} [label="{label}", fillcolor="{_FILL[_kind(n)]}", '
                   f'tooltip="{esc(n.format_node() or n.name)}"];')
    for n in graph.nodes:
        for a in n.all_input_nodes:
            if a in ids:
                out.append(f"  {ids[a]} -> {ids[n]};")
    out.append("}")
    return "\n".join(out) + "\n"


def graphviz_svg(graph: fx.Graph, title: str = "") -> str:
    """SVG laid out by graphviz's ``dot`` program; raises if ``dot`` is not installed or fails."""
    import shutil
    import subprocess

    dot = shutil.which("dot")
    if dot is None:
        raise RuntimeError("graphviz's dot program is not on PATH")
    res = subprocess.run([dot, "-Tsvg"], input=to_dot(graph, title), capture_output=True, text=True, timeout=300,
                         check=False)
    if res.returncode != 0 or "<svg" not in res.stdout:
        raise RuntimeError(f"dot failed: {' '.join(res.stderr.split())[:300]}")
    return res.stdout


def graph_svg(gm: fx.GraphModule, path: str | Path, title: str = "", backend: str = "auto") -> str:
    """Write ``gm``'s graph as SVG to ``path``; returns the backend used ("graphviz" or "builtin").

    ``backend``: "graphviz" (fail if ``dot`` is missing), "builtin", or "auto" (graphviz
    when available, else builtin).
    """
    if backend not in ("auto", "graphviz", "builtin"):
        raise ValueError(f"svg backend must be auto, graphviz or builtin, got {backend!r}")
    text, used = None, "builtin"
    if backend in ("auto", "graphviz"):
        try:
            text, used = graphviz_svg(gm.graph, title), "graphviz"
        except Exception as e:
            if backend == "graphviz":
                raise RuntimeError(f"cannot draw with graphviz ({e}); install graphviz (apt-get install graphviz), "
                                   "or use --svg-backend builtin") from e
    if text is None:
        text = builtin_svg(gm.graph, title)
    Path(path).write_text(text)
    return used
