"""Token budgets chosen from the traffic, for packed plans with ``batch_sizes="auto"``.

A packed plan's graph serves every call of at most its budget's tokens, padded to it; padding
is real work on the GPU, and each budget costs a capture and its output buffers in the pool.
:class:`BudgetPlanner` chooses the budgets from the token totals that come, so that a stream
of mixed sizes is served by few graphs with little padding:

- a plan is at most ``cap`` budgets, each a multiple of ``step``, the largest at most
  ``largest``; the least padding the totals seen would have had with at most ``cap`` budgets
  (:func:`best_budgets`, exact) is the target, and the fewest budgets within
  :data:`GRAPH_WORTH` of the tokens seen of it are chosen: a graph more must save that much;
- the plan held is kept while its padding over the totals seen stays within
  :data:`REPLAN_GAIN` of the tokens seen of the least possible, and replaced by the best plan
  otherwise, or when a call fits none of its budgets. So, after every call, the plan pads the
  totals seen by at most the least padding any ``cap`` budgets would have plus
  ``REPLAN_GAIN`` of their tokens.

The least possible padding never falls as totals are added, so the plan is searched again only
when its own padding has grown by more than ``REPLAN_GAIN`` of the tokens since the last
search: rarely, once the traffic's sizes have been seen. Each search takes
``cap * distinct totals ** 2 / 2`` steps.

This module holds the decision only: it knows token counts, never graphs or tensors, so all
of it runs and is tested on the CPU. The runner drops the graphs of budgets a new plan leaves
out and captures its budgets when calls first need them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

__all__ = [
    "GRAPH_WORTH",
    "PACKED_MAX_GRAPHS",
    "REPLAN_GAIN",
    "BudgetPlanner",
    "best_budgets",
    "padding",
]

PACKED_MAX_GRAPHS = 8
"""The default ``max_graphs`` of a packed plan: its budgets are chosen to make do with few."""
GRAPH_WORTH = 0.01
"""A plan takes a budget more only if that saves more padding than this share of the tokens
seen."""
REPLAN_GAIN = 0.03
"""The plan held is replaced once the best plan would pad less by more than this share of the
tokens seen."""


def padding(totals: Mapping[int, int], budgets: tuple[int, ...]) -> int | None:
    """Padding tokens of ``totals`` (calls by token total) served each by the smallest of
    ``budgets`` that holds it; ``None`` if a total is above every budget."""
    ordered = sorted(budgets)
    padded = 0
    for total, count in totals.items():
        budget = next((b for b in ordered if b >= total), None)
        if budget is None:
            return None
        padded += count * (budget - total)
    return padded


def best_budgets(totals: Mapping[int, int], cap: int, step: int) -> tuple[tuple[int, ...], int]:
    """The budgets, multiples of ``step``, that serve ``totals`` (calls by token total) with the
    least padding using at most ``cap`` of them, taking the fewest whose padding is within
    :data:`GRAPH_WORTH` of the tokens of that least; with the least padding.

    Exact: the best budgets are among the totals rounded up to ``step`` (a budget between two
    of them pads more than the larger of them would), and a dynamic programme over those, in
    order, finds the best split into at most ``cap`` groups, each served by its largest.
    """
    if not totals:
        raise ValueError("no token totals to choose budgets for")
    rounded: Counter[int] = Counter()
    raw: Counter[int] = Counter()
    for total, count in totals.items():
        value = -(-total // step) * step
        rounded[value] += count
        raw[value] += count * total
    values = sorted(rounded)
    n = len(values)
    calls, tokens = [0], [0]  # prefix sums over values[:i]
    for value in values:
        calls.append(calls[-1] + rounded[value])
        tokens.append(tokens[-1] + raw[value])

    def group(first: int, last: int) -> int:
        """Padding of the totals rounded to ``values[first..last]``, served by the last."""
        return values[last] * (calls[last + 1] - calls[first]) - (tokens[last + 1] - tokens[first])

    infinite = float("inf")
    # least[k][j]: least padding of values[:j] with k budgets, the last one values[j - 1].
    least = [[infinite] * (n + 1) for _ in range(min(cap, n) + 1)]
    choice = [[0] * (n + 1) for _ in range(min(cap, n) + 1)]
    least[0][0] = 0
    for k in range(1, min(cap, n) + 1):
        previous, row, chosen = least[k - 1], least[k], choice[k]
        for j in range(k, n + 1):
            best, where = infinite, 0
            for i in range(k - 1, j):
                if previous[i] == infinite:
                    continue
                cost = previous[i] + group(i, j - 1)
                if cost < best:
                    best, where = cost, i
            row[j], chosen[j] = best, where
    floor = min(least[k][n] for k in range(1, min(cap, n) + 1))
    allowed = floor + GRAPH_WORTH * tokens[n]
    count = next(k for k in range(1, min(cap, n) + 1) if least[k][n] <= allowed)
    budgets, j = [], n
    for k in range(count, 0, -1):
        budgets.append(values[j - 1])
        j = choice[k][j]
    return tuple(sorted(budgets)), int(floor)


class BudgetPlanner:
    """The token budgets of one packed plan, chosen from the totals of its calls.

    :meth:`budget_for` is asked once per call (each piece of a split call is a call) and
    returns the budget that serves it, re-planning first when this module's rules say so;
    :attr:`budgets` is the plan held and :attr:`generation` counts its changes.
    """

    def __init__(self, step: int, largest: int, cap: int) -> None:
        if step < 1 or largest < step or largest % step or cap < 1:
            raise ValueError(
                f"budgets need a positive step, largest a multiple of it and cap at least 1; "
                f"got step {step}, largest {largest}, cap {cap}"
            )
        self.step = step
        self.largest = largest
        self.cap = cap
        self.budgets: tuple[int, ...] = ()
        self.generation = 0
        self.totals: Counter[int] = Counter()
        """Calls seen by token total."""
        self._tokens = 0
        self._padding = 0
        """Padding of the totals seen under the plan held."""
        self._floor = 0
        """The least padding of the totals seen at the last search: a lower bound of it now."""

    def budget_for(self, size: int) -> int | None:
        """The budget serving a call of ``size`` tokens, the call counted; ``None`` for one
        above ``largest`` (split by the caller, its pieces asked for)."""
        if size > self.largest:
            return None
        self.totals[size] += 1
        self._tokens += size
        budget = next((b for b in self.budgets if b >= size), None)
        if budget is None:
            self._replan()
        else:
            self._padding += budget - size
            if self._padding > self._floor + REPLAN_GAIN * self._tokens:
                self._search()
        return next(b for b in self.budgets if b >= size)

    def _search(self) -> None:
        """Search the best plan; take it if the plan held pads beyond this module's bound."""
        budgets, self._floor = best_budgets(self.totals, self.cap, self.step)
        if self._padding > self._floor + REPLAN_GAIN * self._tokens:
            self._take(budgets)

    def _replan(self) -> None:
        """Take the best plan for the totals seen (the plan held cannot serve the last)."""
        budgets, self._floor = best_budgets(self.totals, self.cap, self.step)
        self._take(budgets)

    def _take(self, budgets: tuple[int, ...]) -> None:
        self.budgets = budgets
        self._padding = padding(self.totals, budgets) or 0  # the best plan serves them all
        self.generation += 1
