"""The layer extrapolation on synthetic graphs: a graph of k layers built by the rule of
``tools.plan_layers`` (constant runs and blocks repeated k - 2 times, live bytes affine in the
layer count and the copy, the first and last copies offset), and graphs that break that rule.
The real graphs are checked against direct captures in test_plan.py."""
from longshield_fx.tools import plan_layers
from longshield_fx.tools.plan_layers import LAYERS

HEAD, BLOCK, MIDDLE, NORMS, TAIL = ["a", "b", "c"], ["mm", "add", "mul"], ["first", "x", "last"], ["norm", "sum"], ["o"]


def graph(k: int, block=BLOCK):
    """(ops, live bytes, names) of the synthetic k-layer graph: HEAD, k - 2 copies of ``block``,
    MIDDLE, k - 2 copies of NORMS, TAIL."""
    ops, live = [], []
    for part, repeated in ((HEAD, False), (block, True), (MIDDLE, False), (NORMS, True), (TAIL, False)):
        n = k - 2
        for m in range(n if repeated else 1):
            for p, op in enumerate(part):
                ops.append(op)
                base = 1000 * p + 7 * k + (50 * m + 3 * (m == 0) - 11 * (m == n - 1) if repeated else 0)
                live.append(base + (400 if part is MIDDLE else 0) * k)
    return ops, live, [f"{op}_{i}" for i, op in enumerate(ops)]


def test_an_extrapolated_graph_has_the_peak_of_the_graph_built_whole():
    graphs = {k: graph(k) for k in LAYERS}
    parts = plan_layers.template({k: g[0] for k, g in graphs.items()})
    assert [(kind, xs) for kind, xs in parts if xs] == [("const", HEAD), ("repeat", BLOCK), ("const", MIDDLE),
                                                        ("repeat", NORMS), ("const", TAIL)]
    for L in (7, 12, 32):
        timeline, names = plan_layers.extrapolate(parts, {k: g[1] for k, g in graphs.items()}, graphs[6][2], L)
        assert max(timeline) == max(graph(L)[1])
        assert len(timeline) == len(names) and any("(layer block" in name for name in names)


def test_a_graph_that_breaks_the_rule_is_refused():
    graphs = {k: graph(k) for k in LAYERS}
    ops = {k: g[0] for k, g in graphs.items()}
    parts = plan_layers.template(ops)
    live = {k: list(g[1]) for k, g in graphs.items()}
    live[5][len(HEAD) + len(BLOCK)] += 1  # one byte off the rule, in a middle copy of the 5-layer graph
    assert plan_layers.extrapolate(parts, live, graphs[6][2], 32) is None
    assert plan_layers.template({**ops, 5: ops[5][:-1]}) is None  # a node missing
    odd = graph(5, block=["mm", "add", "div"])[0]  # one layer's ops differ from the others'
    assert plan_layers.template({**ops, 5: odd}) is None
