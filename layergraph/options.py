"""How a wrapped model's graphs are captured and served: the runner's options.

The keyword options of :func:`layergraph.wrap` that the engine and its lanes read; validated
when made, so a bad value fails at ``wrap`` with a message naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["DEFAULT_BATCH_SIZES", "DEFAULT_MAX_GRAPHS", "RunnerOptions"]

DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
"""A common choice of fixed buckets (``batch_sizes=DEFAULT_BATCH_SIZES``): powers of two."""

DEFAULT_MAX_GRAPHS = 32
"""The default ``max_graphs`` of a plan keyed by batch size (packed plans:
:data:`~layergraph.serving.budgets.PACKED_MAX_GRAPHS`)."""


@dataclass(frozen=True)
class RunnerOptions:
    """How a runner captures and serves graphs; the keyword options of :func:`layergraph.wrap`.

    - ``batch_sizes``: ``"auto"`` (the default): each batch size that comes gets a graph of its
      own, kept only if measured faster than eager; a batch without one is served by the
      cheapest combination of graphs held (padded, or in chunks) when measured faster than
      eager, else eagerly (:mod:`layergraph.serving.policy`). A sequence of sizes: fixed buckets, a
      smaller batch padded up to the next, a batch larger than all split into chunks of the
      largest. ``None``: one graph per exact batch size, no padding, no splitting. In every
      mode a graph measured slower than an eager call of its own batch is dropped at capture,
      and its calls run eagerly.
    - ``lazy``: capture a key the first time a call needs it. Off: only keys captured through
      :meth:`~layergraph.runner.GraphRunner.capture` replay; other calls run eagerly.
    - ``max_graphs``: no more graphs than this; once all are held, a new key displaces the
      least used graph only after it was seen more often than that graph was used, and runs
      eagerly until then (:class:`~layergraph.serving.cache.GraphCache`). ``None`` (the default):
      32, or 8 for a packed plan, whose learnt token budgets are chosen to make do with that many
      (:mod:`layergraph.serving.budgets`).
    - ``capture_after``: capture a key only once calls have needed it this many times (the
      calls before run eagerly), so that rare shapes do not take graph memory.
    - ``static_output``: return views of the graph's own output buffers (no copy). They are
      overwritten by the next replay of the same key, which warns if an earlier output is still
      referenced; by default each call returns fresh tensors.
    - ``validate``: compare the first replay of each key with eager on the same input and raise
      :class:`~layergraph.validation.GraphMismatchError` beyond ``tolerance`` (relative error;
      ``None`` takes the per-dtype default); and raise the error of a capture that fails
      though its warm-up runs did not, where by default its key runs eagerly with a
      :class:`~layergraph.serving.engine.CaptureFailedWarning`.
    - ``warmup_runs``: eager runs on a side stream before each capture.
    - ``debug``: check at every replay that each buffer the graph uses (static inputs and
      outputs, per-key state, the model's parameters) still has its captured address.
    - ``observe_calls``: a packed plan with learnt budgets serves this many first calls
      eagerly, observing their token totals, before it chooses budgets
      (:mod:`layergraph.serving.budgets`); ``None`` (the default): four times ``max_graphs``. Other
      plans ignore it.
    """

    batch_sizes: Sequence[int] | Literal["auto"] | None = "auto"
    lazy: bool = True
    max_graphs: int | None = None
    capture_after: int = 1
    static_output: bool = False
    validate: bool = False
    tolerance: float | None = None
    warmup_runs: int = 2
    debug: bool = False
    observe_calls: int | None = None

    def __post_init__(self) -> None:
        for name in ("lazy", "static_output", "validate", "debug"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_graphs is not None and self.max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, got {self.max_graphs}")
        if self.warmup_runs < 1:
            raise ValueError(f"warmup_runs must be at least 1, got {self.warmup_runs}")
        if self.observe_calls is not None and self.observe_calls < 0:
            raise ValueError(f"observe_calls must be at least 0, got {self.observe_calls}")
        if self.capture_after < 1:
            raise ValueError(f"capture_after must be at least 1, got {self.capture_after}")
        if isinstance(self.batch_sizes, str) and self.batch_sizes != "auto":
            raise ValueError(
                f"batch_sizes must be 'auto', None or a sequence of sizes, got {self.batch_sizes!r}"
            )

    @property
    def measured(self) -> bool:
        """Whether batch sizes are served the way measured fastest (``batch_sizes="auto"``)."""
        return self.batch_sizes == "auto"
