"""How a wrapped model's calls are served: the rooms behind :class:`~layergraph.GraphedModule`.

- :mod:`~layergraph.serving.engine`: one key at a time (capture, replay, measure, settle,
  forget), behind one :class:`~layergraph.serving.engine.Lane` protocol;
- :mod:`~layergraph.serving.batched_lane` and :mod:`~layergraph.serving.packed_lane`: which key
  serves a call, by batch size or by token budget;
- :mod:`~layergraph.serving.gate`: why a call runs eagerly;
- :mod:`~layergraph.serving.cache`: the graphs held, read by the lanes through the engine;
- :mod:`~layergraph.serving.policy` and :mod:`~layergraph.serving.budgets`: the measured shape
  policy and the token budgets learnt from the traffic.

Users reach them through ``wrap`` and its options; plugin code never imports them. The
embedding service that used to live at this path is :mod:`layergraph.service`; its names
(``ImageEncoder``, ``MicroBatcher``, ``EmbedBatches``, ``default_embed``) are still found
here, with a ``LayergraphDeprecationWarning``, until layergraph 0.3.
"""

from __future__ import annotations

from ..warn import LayergraphDeprecationWarning, warn

_MOVED_TO_SERVICE = ("EmbedBatches", "ImageEncoder", "MicroBatcher", "default_embed")


def __getattr__(name: str) -> object:
    """The embedding service's names at their old path, with a ``LayergraphDeprecationWarning``."""
    if name in _MOVED_TO_SERVICE:
        from .. import service

        warn(
            f"layergraph.serving.{name} is layergraph.service.{name} since layergraph 0.2.0; "
            "the old path goes in 0.3",
            LayergraphDeprecationWarning,
        )
        value = globals()[name] = getattr(service, name)  # one warning per name
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
