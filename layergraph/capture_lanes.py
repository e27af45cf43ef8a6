"""The old name of :mod:`layergraph.capture_streams`, kept with a ``LayergraphDeprecationWarning``
until layergraph 0.3 (a capture stream was called a capture lane, a word the engine's lanes use)."""

from __future__ import annotations

import warnings

from .capture_streams import CaptureStream, free_streams, take_stream
from .warn import LayergraphDeprecationWarning

__all__ = ["CaptureLane", "free_lanes", "take_lane"]

warnings.warn(
    "layergraph.capture_lanes is layergraph.capture_streams since layergraph 0.2.0 "
    "(CaptureLane: CaptureStream, take_lane: take_stream, free_lanes: free_streams); the old "
    "names go in 0.3",
    LayergraphDeprecationWarning,
    stacklevel=2,
)

CaptureLane = CaptureStream
take_lane = take_stream
free_lanes = free_streams
