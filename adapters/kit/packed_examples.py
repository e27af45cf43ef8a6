"""The packed-tower adapter's deprecated example models (goes in 0.3).

Example models come from a plugin's ``example_model`` hook (:mod:`layergraph.bench.examples`);
the first-party packed families' are in ``layergraph_adapters.example_models.packed``. An
adapter that still names its examples in :attr:`PackedExamples.examples` and
:attr:`PackedExamples.vlm_examples` keeps them served through this mixin, which
:class:`~layergraph_adapters.kit.packed_tower.PackedTowerAdapter` inherits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from layergraph_adapters.kit.tower_specs import TowerExample, build_tower, transformers_class

if TYPE_CHECKING:
    from layergraph.bench.example_model import ExampleModel

__all__ = ["EXAMPLE_IMAGE_SIZE", "PackedExamples"]

EXAMPLE_IMAGE_SIZE = 448
"""Deprecated (goes in 0.3): ``layergraph_adapters.example_models.packed.EXAMPLE_IMAGE_SIZE``."""


class PackedExamples:
    """An adapter's example towers and VLMs by name, deprecated."""

    name: str
    examples: ClassVar[Mapping[str, TowerExample]] = {}
    """Deprecated (goes in 0.3; example models come from a plugin's ``example_model`` hook,
    :mod:`layergraph.bench.examples`): well-known towers the adapter serves, by name, fed
    images of :data:`EXAMPLE_IMAGE_SIZE` (or the example's ``image_size``) by
    :meth:`example_inputs`."""
    vlm_examples: ClassVar[Mapping[str, TowerExample]] = {}
    """Deprecated likewise: well-known VLMs holding such a tower, given prompts by
    :meth:`example_prompt`."""

    def example_models(self) -> list[str]:
        return [*self.examples, *self.vlm_examples]

    def example_model(self, name: str) -> ExampleModel | None:
        from layergraph.bench.example_model import ExampleModel

        vlm = name in self.vlm_examples
        example = self.vlm_examples[name] if vlm else self.examples.get(name)
        if example is None:
            return None
        side = example.image_size or EXAMPLE_IMAGE_SIZE

        def build(dtype: torch.dtype, device: torch.device) -> nn.Module:
            return build_tower(example.tower, example.settings, dtype, device)

        def config() -> Any:
            return transformers_class(example.tower).config_class(**example.settings)

        def prompt(
            sizes: Sequence[tuple[int, int]], dtype: torch.dtype, device: torch.device
        ) -> dict[str, Any]:
            return self.example_prompt(config(), sizes, dtype, device)

        def sized_inputs(
            sizes: Sequence[tuple[int, int]], dtype: torch.dtype, device: torch.device
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if vlm:
                return (), prompt(sizes, dtype, device)
            return self.example_inputs(config(), sizes, dtype, device)

        return ExampleModel(
            name=name,
            adapter=self.name,
            build=build,
            inputs=lambda batch, dtype, device: sized_inputs([(side, side)] * batch, dtype, device),
            sized_inputs=sized_inputs,
            prompt=prompt if vlm else None,
        )

    def example_inputs(
        self,
        config: Any,
        sizes: Sequence[tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """One call's ``(args, kwargs)`` for a tower of ``config``: random images of ``sizes``
        (``(height, width)`` in pixels), resized and laid out as the family's processor and
        VLMs do, in ``dtype`` on ``device``. Deprecated with :attr:`examples`."""
        raise NotImplementedError(f"the {self.name} adapter has no example towers")

    def example_prompt(
        self,
        config: Any,
        sizes: Sequence[tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> dict[str, Any]:
        """One prompt's keyword inputs for a VLM of ``config``: a few random text tokens
        around images of ``sizes`` (``(height, width)`` in pixels), laid out as the VLM's
        processor lays them out, in ``dtype`` on ``device``. Deprecated with
        :attr:`vlm_examples`."""
        raise NotImplementedError(f"the {self.name} adapter has no example VLMs")
