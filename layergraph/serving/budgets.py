"""Token budgets chosen from the traffic, for packed plans with ``batch_sizes="auto"``.

A packed plan's graph serves every call of at most its budget's tokens, padded to it; padding
is real work on the GPU, and each budget costs a capture (warm-up, capture, measurement: a few
runs of the budget's work) and its output buffers in the pool. :class:`BudgetPlanner` chooses
the budgets from the token totals that come, so that a stream of mixed sizes is served by few
graphs with little padding and few captures:

- the first ``observed`` calls (by default :data:`OBSERVED_PER_BUDGET` times ``cap``) are
  only observed (the runner serves them eagerly): a plan of ``cap`` budgets chosen from fewer
  calls is mostly a guess, and each guess corrected costs captures;
- a plan is at most ``cap`` budgets, each a multiple of ``step``, the largest at most
  ``largest``. Its largest, the *top*, is the largest total seen with :data:`TOP_ROOM` more
  room (rounded to ``step``, at most ``largest``), so that a somewhat larger call later still
  fits: a new top means a fresh pool, every graph captured again, the top first;
- the first plan, and a plan under a new top, captures all of its budgets whichever they are:
  it is the least padding of the totals seen with at most ``cap`` budgets
  (:func:`best_budgets`, exact), taking the fewest budgets within :data:`GRAPH_WORTH` of the
  tokens seen of that least: a graph more must save that much;
- later, a plan is priced: its padding of the totals seen, plus :data:`CAPTURE_COST` times the
  tokens of every budget it would capture (each budget not held). The held plan is replaced
  only when a call fits none of its budgets (a new top), or when a search finds a plan priced
  below the held plan's padding: the padding it would have saved over the calls seen must pay
  for its captures, the calls to come taken to be as many as those seen. A search runs when
  the held plan's padding has grown by :data:`REPLAN_GAIN` of the tokens seen since the last
  one.

So, after every call, the plan held serves every total seen, and pads them by at most the least
padding any ``cap`` budgets under the same top would have, plus ``REPLAN_GAIN + GRAPH_WORTH``
of their tokens, plus ``CAPTURE_COST`` times the tokens of the budgets of that least plan it
does not hold: an amount that does not grow with the traffic, so that, as calls come, the
plan's padding approaches the least, while a stream that has not yet run long enough to repay
a capture keeps the graphs it has. Each search takes about ``cap * d * log2(d)`` steps for
``d`` distinct totals (rounded to the step: at most ``largest / step``, 1024 for the packed
adapters), and runs in the call that triggers it: 15 ms for 842 totals on a slow CPU.

This module holds the decision only: it knows token counts, never graphs or tensors, so all
of it runs and is tested on the CPU. The runner drops the graphs of budgets a new plan leaves
out (all of them under a new top, so that the pool starts afresh) and captures a fresh
pool's budgets all at once, largest first; it captures budgets a later plan adds when calls
first need them.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Collection, Mapping

__all__ = [
    "CAPTURE_COST",
    "GRAPH_WORTH",
    "OBSERVED_PER_BUDGET",
    "PACKED_MAX_GRAPHS",
    "REPLAN_GAIN",
    "TOP_ROOM",
    "BudgetPlanner",
    "best_budgets",
    "padding",
    "top_budget",
]

PACKED_MAX_GRAPHS = 8
"""The default ``max_graphs`` of a packed plan: its budgets are chosen to make do with few."""
GRAPH_WORTH = 0.01
"""A plan takes a budget more only if that saves more than this share of the tokens seen."""
REPLAN_GAIN = 0.03
"""The held plan's padding grows by this share of the tokens seen between two searches."""
CAPTURE_COST = 6.0
"""What capturing a budget costs a plan, in padding tokens per token of the budget: a capture
runs the budget's work about this many times (a warm-up, the capture, a measured eager call
and replays), where a padding token costs about a token's work at every call it pads."""
TOP_ROOM = 0.25
"""The top budget has this share more tokens than the largest total seen."""
OBSERVED_PER_BUDGET = 4
"""Calls observed before the first plan, per budget a plan may hold: with two, the first plan
of the packed towers' benchmark stream padded its later calls by a quarter more than with
four, and was replaced within the stream (``benchmarks/budget_replay.py``)."""


def padding(totals: Mapping[int, int], budgets: Collection[int]) -> int | None:
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


def top_budget(totals: Mapping[int, int], step: int, largest: int) -> int:
    """The largest budget of a plan for ``totals``: the largest total with :data:`TOP_ROOM`
    more, rounded up to ``step``, at most ``largest``."""
    roomy = int(max(totals) * (1 + TOP_ROOM))
    return min(largest, -(-roomy // step) * step)


def best_budgets(
    totals: Mapping[int, int],
    cap: int,
    step: int,
    top: int | None = None,
    held: Collection[int] | None = None,
) -> tuple[tuple[int, ...], float]:
    """The cheapest budgets, multiples of ``step``, ``top`` the largest (default: the largest
    total rounded up), that serve ``totals`` (calls by token total) with at most ``cap`` of
    them, and their price: the fewest budgets whose price is within :data:`GRAPH_WORTH` of
    the tokens of the least price.

    A plan's price is its padding plus, unless ``held`` is ``None`` (every plan captures all
    its budgets: the first, or one under a new top), :data:`CAPTURE_COST` times the tokens of
    each budget not in ``held``. Exact: the other budgets are among the totals rounded up to
    ``step`` (a budget between two of them pads more than the larger of them would, and costs
    as much to capture unless held, and the held budgets are such totals), and a dynamic
    programme over those, in order, finds the cheapest split into at most ``cap`` groups, each
    served by its largest.
    """
    if not totals:
        raise ValueError("no token totals to choose budgets for")
    rounded: Counter[int] = Counter()
    raw: Counter[int] = Counter()
    for total, count in totals.items():
        value = -(-total // step) * step
        rounded[value] += count
        raw[value] += count * total
    top = max(rounded) if top is None else top
    if top < max(rounded) or top % step:
        raise ValueError(f"top budget {top} is not a multiple of {step} above every total")
    values = [*sorted(value for value in rounded if value < top), top]
    n = len(values)
    calls, tokens = [0], [0]  # prefix sums over values[:i]
    for value in values:
        calls.append(calls[-1] + rounded[value])
        tokens.append(tokens[-1] + raw[value])

    def group(first: int, last: int) -> float:
        """Price of the totals rounded to ``values[first..last]``, served by the last."""
        budget = values[last]
        padded = budget * (calls[last + 1] - calls[first]) - (tokens[last + 1] - tokens[first])
        return padded + (0 if held is None or budget in held else CAPTURE_COST * budget)

    infinite = float("inf")
    levels = min(cap, n)
    # least[k][j]: least price of values[:j] with k budgets, the last one values[j - 1].
    least = [[infinite] * (n + 1) for _ in range(levels + 1)]
    choice = [[0] * (n + 1) for _ in range(levels + 1)]
    least[0][0] = 0
    for k in range(1, levels + 1):
        _fill_level(least[k - 1], least[k], choice[k], k, n, group)
    floor = min(least[k][n] for k in range(1, levels + 1))
    allowed = floor + GRAPH_WORTH * tokens[n]
    count = next(k for k in range(1, levels + 1) if least[k][n] <= allowed)
    budgets, j = [], n
    for k in range(count, 0, -1):
        budgets.append(values[j - 1])
        j = choice[k][j]
    return tuple(sorted(budgets)), least[count][n]


def _fill_level(
    previous: list[float],
    row: list[float],
    chosen: list[int],
    k: int,
    n: int,
    group: Callable[[int, int], float],
) -> None:
    """``row[j]`` for ``j`` from ``k`` to ``n``: the least price of the first ``j`` values with
    ``k`` budgets, ``previous[i] + group(i, j - 1)`` at its best ``i`` (``chosen[j]``, the
    smallest of the best).

    A group's price is its padding (its budget times its calls, less their tokens) plus a
    capture cost that depends on its budget alone, so ``group`` satisfies the quadrangle
    inequality (for ``a <= b <= c <= d``, ``group(a, c) + group(b, d)`` exceeds ``group(a, d)
    + group(b, c)`` by the calls of ``a`` to ``b - 1`` times ``budget(c) - budget(d) <= 0``):
    the best ``i`` does not decrease as ``j`` grows. Divide and conquer over ``j`` then finds
    every row's best in ``n log n`` group prices instead of ``n ** 2``: a search over 842
    totals took 165 ms the quadratic way on a slow CPU, 15 ms this way."""
    stack = [(k, n, k - 1, n - 1)]
    while stack:
        low, high, first, last = stack.pop()
        if low > high:
            continue
        j = (low + high) // 2
        best, where = float("inf"), first
        for i in range(first, min(j - 1, last) + 1):
            cost = previous[i] + group(i, j - 1)
            if cost < best:
                best, where = cost, i
        row[j], chosen[j] = best, where
        stack.append((low, j - 1, first, where))
        stack.append((j + 1, high, where, last))


class BudgetPlanner:
    """The token budgets of one packed plan, chosen from the totals of its calls.

    While :attr:`observing`, the runner serves each call eagerly and counts it with
    :meth:`observe`. Then :meth:`budget_for` is asked once per call (each piece of a split
    call is a call) and returns the budget that serves it, re-planning first when this
    module's rules say so;
    :attr:`budgets` is the plan held, :attr:`top` its largest, :attr:`generation` counts its
    changes and :attr:`pools` the changes of its top.
    """

    def __init__(self, step: int, largest: int, cap: int, observed: int | None = None) -> None:
        if step < 1 or largest < step or largest % step or cap < 1:
            raise ValueError(
                f"budgets need a positive step, largest a multiple of it and cap at least 1; "
                f"got step {step}, largest {largest}, cap {cap}"
            )
        self.step = step
        self.largest = largest
        self.cap = cap
        self.observed = OBSERVED_PER_BUDGET * cap if observed is None else observed
        """Calls observed before the first plan."""
        self.budgets: tuple[int, ...] = ()
        self.generation = 0
        self.pools = 0
        """Plans taken with a new top: each starts a fresh pool."""
        self.totals: Counter[int] = Counter()
        """Calls seen by token total."""
        self._tokens = 0
        self._padding = 0
        """Padding of the totals seen under the plan held."""
        self._next_search = 0
        """The held plan's padding at which the next search runs."""

    @property
    def observing(self) -> bool:
        """Whether calls are still only observed: no plan yet, fewer calls seen than
        :attr:`observed`."""
        return not self.budgets and sum(self.totals.values()) < self.observed

    def observe(self, size: int) -> None:
        """Count a call of ``size`` tokens (at most ``largest``) served eagerly while
        :attr:`observing`; the first plan is chosen from it and the others."""
        self.totals[size] += 1
        self._tokens += size

    def start_from(self, totals: Mapping[int, int], budgets: Collection[int] = ()) -> None:
        """Count the calls of ``totals`` (calls by token total, as another process's planner
        saw them: a warm start) and, unless a plan is held, take ``budgets`` (that planner's
        plan) as the first plan, or, if they do not fit this planner's step, largest and cap
        or leave a total out, the best plan for the totals; so that no call is observed
        eagerly first. Totals above ``largest`` are left out."""
        fitting = {size: calls for size, calls in totals.items() if 0 < size <= self.largest}
        if not fitting:
            return
        self.totals.update(fitting)
        self._tokens += sum(size * calls for size, calls in fitting.items())
        if self.budgets:
            return
        plan = tuple(sorted(set(budgets)))
        fits = (
            0 < len(plan) <= self.cap
            and all(b % self.step == 0 and 0 < b <= self.largest for b in plan)
            and padding(self.totals, plan) is not None
        )
        if not fits:
            top = top_budget(self.totals, self.step, self.largest)
            plan = best_budgets(self.totals, self.cap, self.step, top)[0]
        self._take(plan)

    @property
    def top(self) -> int | None:
        """The largest budget held (``None`` before the first call)."""
        return self.budgets[-1] if self.budgets else None

    def budget_for(self, size: int) -> int | None:
        """The budget serving a call of ``size`` tokens, the call counted; ``None`` for one
        above ``largest`` (split by the caller, its pieces asked for)."""
        if size > self.largest:
            return None
        self.observe(size)
        budgets = self.budgets
        index = bisect.bisect_left(budgets, size)
        if index == len(budgets):
            top = top_budget(self.totals, self.step, self.largest)
            self._take(best_budgets(self.totals, self.cap, self.step, top)[0])
        else:
            self._padding += budgets[index] - size
            if self._padding <= self._next_search:
                return budgets[index]
            self._search()
        return self.budgets[bisect.bisect_left(self.budgets, size)]

    def _search(self) -> None:
        """Take the cheapest plan under the held top if its price is below the held plan's
        padding; either way, schedule the next search."""
        budgets, price = best_budgets(self.totals, self.cap, self.step, self.top, self.budgets)
        if price < self._padding and budgets != self.budgets:
            self._take(budgets)
        else:
            self._next_search = self._padding + REPLAN_GAIN * self._tokens

    def _take(self, budgets: tuple[int, ...]) -> None:
        if budgets[-1] != self.top:
            self.pools += 1
        self.budgets = budgets
        self._padding = padding(self.totals, budgets) or 0  # the plan serves them all
        self._next_search = self._padding + REPLAN_GAIN * self._tokens
        self.generation += 1
