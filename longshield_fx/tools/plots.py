"""Pictures the command-line interface writes: the loss-vs-ε plot and a block's graph.

``loss_vs_epsilon`` needs matplotlib (a dependency; the Agg backend, no display).
``write_graph`` writes an FX graph as graphviz DOT text (no dependency) and lays it out as
SVG with graphviz's ``dot`` program when that is installed; without it the .dot file is
what you get, with the command that renders it. (torch.fx's ``FxGraphDrawer`` is not used:
it needs pydot, and its record labels break on einsum equations such as "btp,btd->bpd",
which every per-sample graph has.)
"""
from __future__ import annotations

import math
import shutil
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

from torch import fx


def loss_vs_epsilon(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Plot per-token training loss against the ε spent so far (one point per step), as PNG.

    ``rows`` are the metrics records (``epsilon``, ``loss``; steps with an empty Poisson
    batch have ``loss`` None and are skipped). A running mean over 5 steps is drawn on top,
    and the held-out loss (``eval_loss``, where a row has one) beside it.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    pts = [(r["epsilon"], r["loss"]) for r in rows if r.get("loss") is not None and math.isfinite(r["epsilon"])]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    if pts:
        eps, loss = zip(*pts)
        ax.plot(eps, loss, ".", color="tab:blue", alpha=0.45, label="training loss, per step")
        k = 5
        if len(loss) >= k:
            smooth = [sum(loss[i - k + 1: i + 1]) / k for i in range(k - 1, len(loss))]
            ax.plot(eps[k - 1:], smooth, "-", color="tab:red", label=f"mean of {k} steps")
    held_out = [(r["epsilon"], r["eval_loss"]) for r in rows
                if r.get("eval_loss") is not None and math.isfinite(r["epsilon"])]
    if held_out:
        ax.plot(*zip(*held_out), "o-", color="tab:green", label="held-out loss")
    if pts or held_out:
        ax.legend(loc="upper right")
    ax.set_xlabel("ε spent")
    ax.set_ylabel("loss per token (nats)")
    # A long model path would run off the figure: wrap each line of the title to its width.
    wrapped = "\n".join(textwrap.fill(line, 72) for line in (title or "loss vs privacy spent").splitlines())
    ax.set_title(wrapped, fontsize=9 if wrapped.count("\n") > 2 else None)
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


def to_dot(graph: fx.Graph, title: str = "") -> str:
    """The graph in graphviz DOT. Colours: forward nodes blue, backward red, nodes a pass
    inserted green, inputs and outputs grey; each box shows the op and the output's
    dtype[shape], and its tooltip the whole node."""
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


@dataclass
class GraphFiles:
    dot: Path                 # always written
    svg: Path | None = None   # written when graphviz's dot program is on PATH
    note: str = ""            # how the SVG was made, or how to make it

    def describe(self) -> str:
        return f"{self.svg} ({self.note})" if self.svg else f"{self.dot} ({self.note})"


def render_command(dot: Path) -> str:
    return f"dot -Tsvg {dot} -o {dot.with_suffix('.svg')}"


def write_graph(gm: fx.GraphModule, path: str | Path, title: str = "") -> GraphFiles:
    """Write ``gm``'s graph to ``path`` + ".dot", and to ``path`` + ".svg" when graphviz's
    ``dot`` is installed. Raises if ``dot`` is installed but fails (a DOT text it rejects is a
    bug here)."""
    path = Path(path)
    dot_path = path.with_name(path.name + ".dot")
    dot_path.write_text(to_dot(gm.graph, title))
    dot = shutil.which("dot")
    if dot is None:
        return GraphFiles(dot_path, None, "graphviz's dot is not installed (apt-get install graphviz); "
                                          f"render it with: {render_command(dot_path)}")
    svg_path = dot_path.with_suffix(".svg")
    res = subprocess.run([dot, "-Tsvg", str(dot_path), "-o", str(svg_path)], capture_output=True, text=True,
                         timeout=300, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"graphviz's dot failed on {dot_path}: {' '.join(res.stderr.split())[:300]}")
    return GraphFiles(dot_path, svg_path, f"laid out by graphviz; DOT source {dot_path}")
