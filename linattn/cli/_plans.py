"""What the plan (:func:`linattn.plan_attention`) chooses for typical calls on one array
library: printed by ``linattn info`` and in the header of every report."""

from __future__ import annotations

from typing import Any

import numpy as np

import linattn as la

__all__ = ["CALLS", "call_plans", "plan_line"]

#: Typical calls, by name: the front door's options.
CALLS: dict[str, dict[str, Any]] = {
    "causal": {"causal": True},
    "bidirectional": {},
    "causal, window 4 + 1 sink": {"causal": True, "window": 4, "sink_keys": 1},
    "bidirectional, window 4 + 1 sink": {"window": 4, "sink_keys": 1},
}


def call_plans(library: Any) -> dict[str, Any]:
    """``{call: AttentionPlan}`` for the calls of :data:`CALLS` on small float32 arrays of
    ``library`` (or the error that no executor serves it)."""
    x = library.asarray(np.zeros((1, 8, 4), dtype=np.float32))
    fm = la.FeatureMap(4, 8, seed=0)
    plans: dict[str, Any] = {}
    for name, options in CALLS.items():
        try:
            plans[name] = la.plan_attention(x, x, x, fm, **options)
        except (TypeError, ValueError) as error:
            plans[name] = error
    return plans


def plan_line(library: Any) -> str:
    """One line: the executor of each call of :data:`CALLS`, and the causal scan's path."""
    parts = []
    for name, plan in call_plans(library).items():
        if isinstance(plan, Exception):
            parts.append(f"{name}: error: {plan}")
        else:
            parts.append(f"{name}: {plan.executor}")
    return "; ".join(parts)
