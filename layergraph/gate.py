"""The old path of :mod:`layergraph.serving.gate`, kept with a ``LayergraphDeprecationWarning``
until layergraph 0.3."""

from .warn import moved_module

moved_module(__name__, "layergraph.serving.gate")
