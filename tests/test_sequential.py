"""The generic adapter: a Sequential model, a Sequential inside a model, a named ModuleList."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import layergraph
from layergraph.sequential import CHECKING_REASON
from layergraph.testing import SimulatedGraphs

ATOL = 1e-5


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = x + torch.tanh(self.linear(x))
        return y if scale is None else y * scale


class Encoder(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3, container: type = nn.ModuleList) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.layers = (
            container(*[Block(width) for _ in range(depth)])
            if container is nn.Sequential
            else container([Block(width) for _ in range(depth)])
        )
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(x)
        if isinstance(self.layers, nn.Sequential):
            x = self.layers(x)
        else:
            for layer in self.layers:
                x = layer(x, scale)
        return self.head(x)


def make(container: type) -> Encoder:
    torch.manual_seed(0)
    return Encoder(container=container).eval()


@pytest.mark.parametrize("container", [nn.ModuleList, nn.Sequential])
def test_named_stack_is_graphed_in_place(container: type) -> None:
    model = make(container)
    graphed = layergraph.wrap(
        model, adapter="sequential", stack="layers", backend=SimulatedGraphs()
    )
    with torch.no_grad():
        graphed(torch.randn(2, 5, 4))  # a list's first wrapped call checks how it is iterated
        graphed.release()
        for batch in (1, 3, 8):
            x = torch.randn(batch, 5, 4)
            expected = model(x)
            torch.testing.assert_close(graphed(x), expected, atol=ATOL, rtol=0)
    stats = graphed.stats
    # A list of layers is checked by the first call, run eagerly and counted; nothing else is.
    checking = {CHECKING_REASON: 1} if container is nn.ModuleList else {}
    assert dict(stats.eager_calls) == checking
    assert [key.batch for key in graphed.keys] == [1, 3, 8]  # one per size (batch_sizes="auto")


def test_module_list_shared_tensor_arguments_are_inputs() -> None:
    model = make(nn.ModuleList)
    graphed = layergraph.wrap(
        model, adapter="sequential", stack="layers", backend=SimulatedGraphs()
    )
    with torch.no_grad():
        x, scale = torch.randn(2, 5, 4), torch.rand(2, 5, 8)
        torch.testing.assert_close(graphed(x, scale), model(x, scale), atol=ATOL, rtol=0)
        scale2 = torch.rand(2, 5, 8)
        torch.testing.assert_close(graphed(x, scale2), model(x, scale2), atol=ATOL, rtol=0)
    assert graphed.stats.graphs == 1


def test_model_outside_the_wrapper_and_after_unwrap_is_untouched() -> None:
    model = make(nn.ModuleList)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    graphed = layergraph.wrap(
        model, adapter="sequential", stack="layers", backend=SimulatedGraphs()
    )
    assert len(list(model.layers)) == 3
    assert isinstance(model.layers[1:], nn.ModuleList)
    with torch.no_grad():
        graphed(torch.randn(2, 5, 4))
    assert model.state_dict().keys() == state.keys()
    assert graphed.unwrap() is model
    assert type(model.layers) is nn.ModuleList
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_sequential_stack_forward_is_restored() -> None:
    model = make(nn.Sequential)
    layergraph.wrap(model, adapter="sequential", stack="layers", backend=SimulatedGraphs()).unwrap()
    assert "forward" not in model.layers.__dict__


def test_capture_ahead_through_the_model() -> None:
    model = make(nn.ModuleList)
    graphed = layergraph.wrap(
        model, adapter="sequential", stack="layers", backend=SimulatedGraphs(), batch_sizes=[1, 4]
    )
    with torch.no_grad():
        keys = graphed.capture(torch.randn(1, 5, 4), progress=False)
    assert [key.batch for key in keys] == [4, 1]
    assert graphed.stats.captures == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs an nn.Sequential model or stack="),
        ({"stack": "nope"}, "stack='nope'"),
        ({"stack": "head"}, "is a Linear; it must be an nn.Sequential or an nn.ModuleList"),
    ],
)
def test_bad_stack_names_the_problem(kwargs: dict, message: str) -> None:
    with pytest.raises(layergraph.AdapterMismatch, match=message):
        layergraph.wrap(make(nn.ModuleList), adapter="sequential", **kwargs)


def test_layers_must_return_tensors() -> None:
    class TupleBlock(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (x,)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([TupleBlock()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    graphed = layergraph.wrap(
        Model().eval(), adapter="sequential", stack="layers", backend=SimulatedGraphs()
    )
    with torch.no_grad(), pytest.raises(TypeError, match="layer 0 \\(TupleBlock\\) returned tuple"):
        graphed(torch.randn(2, 3))
    assert graphed.stats.graphs == 0


class Windowed(nn.Module):
    """Qwen2.5-VL's pattern: most layers take window boundaries, some the full ones."""

    def __init__(self, depth: int = 4, full: tuple[int, ...] = (2,)) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(8) for _ in range(depth)])
        self.full = full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        window, whole = torch.full_like(x, 0.5), torch.ones_like(x)
        for index, layer in enumerate(self.layers):
            x = layer(x, whole if index in self.full else window)
        return x


class DeepStack(nn.Module):
    """Qwen3-VL's pattern: features taken from the output of some layers on the way."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(8) for _ in range(4)])
        self.merger = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        features = []
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if index in (0, 2):
                features.append(self.merger(x))
        return x, features


class AllHiddenStates(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = []
        for layer in self.layers:
            x = layer(x)
            hidden.append(x)
        return tuple(hidden)


class EarlyExit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if index == 2:
                break
            x = layer(x)
        return x


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (Windowed(), "layer 2 was called with another argument 2 than layer 0"),
        (DeepStack(), r"reads layer 0's output itself \(torch.nn.functional.linear\)"),
        (AllHiddenStates(), "keeps layer 0's output"),
        (EarlyExit(), "called 2 of the 3 layers"),
    ],
)
def test_layers_not_called_as_one_stack_are_refused(model: nn.Module, message: str) -> None:
    graphed = layergraph.wrap(
        model.eval(), adapter="sequential", stack="layers", backend=SimulatedGraphs()
    )
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        for _ in range(2):  # refused on the first call and every later one
            with pytest.raises(layergraph.AdapterMismatch, match=message):
                graphed(x)
    assert graphed.stats.graphs == 0
    graphed.unwrap()
    with torch.no_grad():
        model(x)  # the model itself is untouched


def test_metadata_reads_between_layers_are_allowed() -> None:
    class Shapes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block(8) for _ in range(3)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                assert x.shape[-1] == 8 and x.dtype == torch.float32
                x = layer(x)
            return x

    model = Shapes().eval()
    graphed = layergraph.wrap(
        model, adapter="sequential", stack="layers", backend=SimulatedGraphs()
    )
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(graphed(x), model(x), atol=ATOL, rtol=0)
    assert graphed.stats.replays == 2


def test_the_models_methods_called_through_the_wrapper_reach_the_graphs() -> None:
    class Vlm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vision = Encoder()

        def get_image_features(self, pixels: torch.Tensor) -> torch.Tensor:
            return self.vision(pixels)

        def forward(self, pixels: torch.Tensor) -> torch.Tensor:
            return self.get_image_features(pixels).sum(-1)

    torch.manual_seed(0)
    vlm = Vlm().eval()
    graphed = layergraph.wrap(
        vlm, adapter="sequential", stack="vision.layers", backend=SimulatedGraphs()
    )
    x = torch.randn(2, 5, 4)
    with torch.no_grad():
        for _ in range(3):
            features = graphed.get_image_features(x)
            torch.testing.assert_close(features, vlm.get_image_features(x), atol=ATOL, rtol=0)
    assert graphed.stats.replays == 2 and graphed.stats.graphs == 1
