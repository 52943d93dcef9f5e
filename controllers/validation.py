"""Small checks shared by the heuristics: is a number usable, and what is wrong with it if not.

They return a short description of the problem (or None) instead of raising, because the policies
fall back to a safe action and record which field was bad; callers that must refuse raise
`ValueError` with that description.
"""

from __future__ import annotations

import math


def number_problem(name: str, value: object, *, minimum: float = 0.0,
                   strictly_positive: bool = False, maximum: float | None = None) -> str | None:
    """None when `value` is a finite number >= minimum (> 0 if strictly_positive, <= maximum)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name}={value!r} is not a number"
    if math.isnan(value):
        return f"{name}=nan"
    if math.isinf(value):
        return f"{name}={value}"
    if strictly_positive and value <= 0:
        return f"{name}={value:g} is not > 0"
    if value < minimum:
        return f"{name}={value:g} is < {minimum:g}"
    if maximum is not None and value > maximum:
        return f"{name}={value:g} is > {maximum:g}"
    return None


def require_number(name: str, value: object, *, minimum: float = 0.0,
                   strictly_positive: bool = False, maximum: float | None = None) -> float:
    """`value` as a float, or ValueError naming the input and what a valid one is."""
    problem = number_problem(name, value, minimum=minimum, strictly_positive=strictly_positive,
                             maximum=maximum)
    if problem is not None:
        bound = "> 0" if strictly_positive else f">= {minimum:g}"
        if maximum is not None:
            bound += f" and <= {maximum:g}"
        raise ValueError(f"{problem}; pass a finite number {bound}")
    return float(value)  # type: ignore[arg-type]
