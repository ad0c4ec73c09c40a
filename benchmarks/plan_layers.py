"""The planner's layer extrapolation against captures of every layer, at the paper's shapes.

For every layout that tests/tools/test_plan.py plans (the three Llamas at cp=4 with block
checkpointing and without it, FSDP-style cp=1, and llama3.2-1b at hp=2 x cp=2), the graph's
peak from the fit extrapolated from 4, 5 and 6 layers (``tools.plan_layers``) and from the fit
of whole captures, at the fit points and at 64k and 256k tokens, and the seconds each fit's
captures took (wall time inside the worker processes, ``--jobs`` of them at once).

    python benchmarks/plan_layers.py [--jobs 2]
"""
import argparse

from longshield_fx.tools import plan as P
from longshield_fx.tools import plan_graphs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    checkpointed = [P.GraphSpec(m, 4, "block", 1, "bf16") for m in P.MODELS]
    specs = checkpointed + [s.plain for s in checkpointed] + [P.GraphSpec(m, 1, None, 1, "bf16") for m in P.MODELS]
    specs.append(P.GraphSpec("llama3.2-1b", 2, None, 1, "bf16", hp=2))
    fitted = [s for s in specs if s not in {c.plain for c in checkpointed}]  # plain cp=4 comes with block
    whole = [(s, T) for s in fitted for T in P.fit_points(s.sp)]
    plan_graphs.prefetch(P.fit_requests(fitted) + whole, jobs=args.jobs)
    print("| layout | layers captured | T | peak, from 4/5/6 layers (bytes) | peak, whole (bytes) | equal |")
    print("|---|---|---|---|---|---|")
    seconds = []
    for spec in specs:
        layered = P.fit_graph(spec)
        full = P.GraphFit.from_captures(spec, *(P.measure(spec, T) for T in P.fit_points(spec.sp)))
        seconds.append((spec, layered.capture_s, full.capture_s))
        for T in (*P.fit_points(spec.sp), 65536, 262144):
            a, b = layered.peak(T)[0], full.peak(T)[0]
            print(f"| {spec.label()} | {layered.layers or 'all'} | {T} | {a:.0f} | {b:.0f} | {'yes' if a == b else 'NO'} |")
    print("\n| layout | capture s, 4/5/6 layers | capture s, whole |")
    print("|---|---|---|")
    for spec, a, b in seconds:
        print(f"| {spec.label()} | {a:.1f} | {b:.1f} |")


if __name__ == "__main__":
    main()
