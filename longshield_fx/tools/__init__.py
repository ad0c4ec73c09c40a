"""Tooling around the compiler, not needed to train: the memory planner (``plan``,
``plan_graphs``, ``paper_tables``), the liveness memory estimate (``memory``), the two-lane
cost model (``cost_model``) and the pictures (``plots``). They read the compiler's output
through its public API (``engine.lower``) and nothing in the compiler imports them."""
