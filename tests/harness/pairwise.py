"""All-pairs case selection: every pair of factor levels appears in some case, far fewer cases than all combinations.

Greedy and deterministic: among the valid combinations, take the one that covers the most pairs not yet
covered, until every pair that some valid combination holds is covered.
"""
from itertools import combinations, product
from typing import Callable, Dict, List, Sequence


def pairwise(factors: Dict[str, Sequence], valid: Callable[[dict], bool] = lambda case: True) -> List[dict]:
    names = list(factors)
    candidates = [dict(zip(names, values)) for values in product(*(factors[n] for n in names))]
    candidates = [case for case in candidates if valid(case)]
    pairs_of = [frozenset(((a, case[a]), (b, case[b])) for a, b in combinations(names, 2)) for case in candidates]
    uncovered = set().union(*pairs_of)
    chosen = []
    while uncovered:
        best = max(range(len(candidates)), key=lambda i: len(pairs_of[i] & uncovered))
        chosen.append(candidates[best])
        uncovered -= pairs_of[best]
    return chosen


def uncovered_pairs(cases: List[dict], factors: Dict[str, Sequence], valid: Callable[[dict], bool]) -> set:
    """The pairs that a valid combination holds but no case does (empty for a complete selection)."""
    names = list(factors)
    possible = set()
    for values in product(*(factors[n] for n in names)):
        case = dict(zip(names, values))
        if valid(case):
            possible |= {((a, case[a]), (b, case[b])) for a, b in combinations(names, 2)}
    held = {((a, case[a]), (b, case[b])) for case in cases for a, b in combinations(names, 2)}
    return possible - held
