"""Forward hooks on a wrapped model: replays run no Python, so changed hooks mean eager calls.

Graphs are simulated (:class:`layergraph.testing.SimulatedGraphs`): a replay re-runs the
captured function in Python, hooks included, so these tests check what the runner decides
(which calls replay, which run eagerly and why), not whether a hook ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

import layergraph
from layergraph.guards import GLOBAL_HOOKS, HookFingerprint, HookWatch
from layergraph.runner import GraphRunner, RunnerOptions
from layergraph.testing import SimulatedGraphs


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block()).eval()


def wrap(module: nn.Module) -> layergraph.GraphedModule:
    return layergraph.wrap(module, adapter="sequential", backend=SimulatedGraphs(), batch_sizes=[4])


def call(graphed: nn.Module, batch: int = 4) -> torch.Tensor:
    with torch.no_grad():
        return graphed(torch.randn(batch, 8))


class Doubler:
    """A forward hook that doubles a module's output and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return output * 2


def test_a_forward_hook_added_after_wrapping_runs_eagerly_and_graphs_return_after_it() -> None:
    net = model()
    graphed = wrap(net)
    call(graphed)
    hook = Doubler()
    handle = net[1].layers[2].register_forward_hook(hook)
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = net(x)
        torch.testing.assert_close(graphed(x), expected)
    assert hook.calls == 2  # the model's own call, then the wrapper's
    reason = "forward hooks changed after wrapping (on 1.layers.2); they run only in eager calls"
    assert graphed.stats.eager_calls == {reason: 1}
    handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), net(x))
    stats = graphed.stats
    assert (stats.replays, stats.captures, stats.eager_total) == (2, 1, 1)


@pytest.mark.parametrize("with_kwargs", [False, True])
def test_a_forward_pre_hook_on_the_model_itself_runs_eagerly(with_kwargs: bool) -> None:
    net = model()
    graphed = wrap(net)
    call(graphed)
    seen: list[int] = []

    def record(module: nn.Module, args: Any, *kwargs: Any) -> None:
        seen.append(args[0].shape[0])

    handle = net.register_forward_pre_hook(record, with_kwargs=with_kwargs)
    call(graphed, 3)
    assert seen == [3]
    (reason,) = graphed.stats.eager_calls
    assert "(on the Sequential itself)" in reason
    handle.remove()
    call(graphed, 3)
    assert seen == [3] and graphed.stats.replays == 2


def test_global_forward_hooks_run_eagerly() -> None:
    graphed = wrap(model())
    call(graphed)
    calls: list[str] = []
    hooks = [
        nn.modules.module.register_module_forward_hook(lambda m, a, o: calls.append("hook")),
        nn.modules.module.register_module_forward_pre_hook(lambda m, a: calls.append("pre")),
    ]
    try:
        call(graphed)
    finally:
        for handle in hooks:
            handle.remove()
    assert "hook" in calls and "pre" in calls
    (reason,) = graphed.stats.eager_calls
    assert "(on all modules (global hooks))" in reason
    call(graphed)
    assert graphed.stats.replays == 2


def test_hooks_present_at_wrapping_keep_graphs_and_their_removal_runs_eagerly() -> None:
    """A hook there at capture is part of the graph; removing it must bring eager back."""
    net = model()
    hook = Doubler()
    handle = net[0].register_forward_hook(hook)
    graphed = wrap(net)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), net(x))
        torch.testing.assert_close(graphed(x), net(x))
    assert graphed.stats.eager_total == 0 and graphed.stats.replays == 2
    handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), net(x))
    assert list(graphed.stats.eager_calls) == [
        "forward hooks changed after wrapping (on 0); they run only in eager calls"
    ]
    net[0].register_forward_hook(hook)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), net(x))
    assert graphed.stats.replays == 3 and graphed.stats.eager_total == 1


def test_accept_current_hooks_rearms_the_baseline_and_drops_older_graphs() -> None:
    net = model()
    graphed = wrap(net)
    runner: GraphRunner = graphed._runner
    call(graphed)
    net[1].register_forward_hook(Doubler())
    runner.accept_current_hooks()
    assert graphed.stats.invalidations == 1 and graphed.stats.graphs == 0
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), net(x))
        torch.testing.assert_close(graphed(x), net(x))
    stats = graphed.stats
    assert (stats.captures, stats.replays, stats.eager_total) == (2, 3, 0)
    runner.accept_current_hooks()  # the same hooks: nothing to drop
    assert graphed.stats.invalidations == 1 and graphed.stats.graphs == 1


def test_the_runner_takes_a_baseline_read_before_the_model_changed() -> None:
    net = model()
    baseline = HookFingerprint.read(net)
    net[0].register_forward_hook(Doubler())
    plan = layergraph.WholeForward(net)
    runner = GraphRunner(plan, RunnerOptions(batch_sizes=[4]), SimulatedGraphs(), hooks=baseline)
    with torch.no_grad():
        runner(torch.randn(4, 8))
    assert runner.stats().eager_total == 1 and runner.stats().graphs == 0
    runner.accept_current_hooks()
    with torch.no_grad():
        runner(torch.randn(4, 8))
    assert runner.stats().replays == 1


def test_a_fingerprint_identifies_hooks_by_the_callables() -> None:
    net = model()

    class Owner:
        def hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
            return None

    owner = Owner()
    before = HookFingerprint.read(net)
    handle = net[0].layers.register_forward_hook(owner.hook)
    during = HookFingerprint.read(net)
    assert before.differences(during) == ("0.layers",)
    handle.remove()
    assert HookFingerprint.read(net) == before
    net[0].layers.register_forward_hook(owner.hook)  # a new bound method of the same hook
    assert HookFingerprint.read(net) == during
    assert during.differences(before) == ("0.layers",)


@pytest.fixture
def global_hook() -> Iterator[RemovableHandle]:
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)
    yield handle
    handle.remove()


def test_a_watch_notices_registration_removal_and_global_hooks(
    global_hook: RemovableHandle,
) -> None:
    net = model()
    watch = HookWatch(net)
    assert watch.differences() == ()
    handle = net[1].layers[0].register_forward_pre_hook(lambda m, a: None, with_kwargs=True)
    assert watch.differences() == ("1.layers.0",)
    handle.remove()
    assert watch.differences() == ()
    del nn.modules.module._global_forward_pre_hooks[global_hook.id]  # no handle, no counter
    assert watch.differences() == (GLOBAL_HOOKS,)


def test_a_watch_notices_a_hooked_module_put_into_the_tree() -> None:
    net = model()
    watch = HookWatch(net)
    hooked = nn.Linear(8, 8)
    hooked.register_forward_hook(Doubler())
    assert watch.differences() == ()
    net[0].layers[2] = hooked
    assert watch.differences() == ("0.layers.2",)


class HooksItselfOnFirstUse(nn.Module):
    """Installs a forward hook on a submodule during its first forward, as transformers does."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.hooked = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.hooked:
            self.hooked = True
            self.inner.register_forward_hook(lambda module, args, output: None)
        return self.inner(x)


class _Whole(layergraph.Adapter):
    name = "whole-model-hooks-test"

    def plan(self, model: nn.Module, context: Any = None) -> layergraph.CapturePlan:
        return layergraph.WholeForward(model)


@pytest.mark.parametrize("first_call", ["captures", "runs eagerly"])
def test_hooks_a_model_installs_on_itself_while_it_runs_keep_graphs_serving(
    first_call: str,
) -> None:
    net = HooksItselfOnFirstUse().eval()
    graphed = layergraph.wrap(net, adapter=_Whole(), backend=SimulatedGraphs(), batch_sizes=[4])
    if first_call == "runs eagerly":
        net.train()
        call(graphed)
        net.eval()
    for _ in range(3):
        call(graphed)
    assert net.hooked and graphed.stats.replays == 3
    assert all("hooks" not in reason for reason in graphed.stats.eager_calls)


def test_a_users_hook_where_the_model_installs_its_own_can_still_be_removed() -> None:
    net = HooksItselfOnFirstUse().eval()
    graphed = layergraph.wrap(net, adapter=_Whole(), backend=SimulatedGraphs(), batch_sizes=[4])
    handle = net.inner.register_forward_hook(Doubler())
    call(graphed)  # eager, for the user's hook; the model installs its own meanwhile
    handle.remove()
    call(graphed)
    call(graphed)
    stats = graphed.stats
    assert (stats.eager_total, stats.captures, stats.replays) == (1, 1, 2)


def test_transformers_output_capturing_hooks_keep_graphs_serving() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
    )
    net = transformers.CLIPVisionModel(config).eval()
    before = HookFingerprint.read(net)
    graphed = layergraph.wrap(net, adapter=_Whole(), backend=SimulatedGraphs(), batch_sizes=[4])
    pixels = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        for _ in range(3):
            got = graphed(pixel_values=pixels, output_hidden_states=True)
        want = net(pixel_values=pixels, output_hidden_states=True)
    assert HookFingerprint.read(net) != before, "transformers installed no hook"
    for have, expected in zip(got.hidden_states, want.hidden_states, strict=True):
        torch.testing.assert_close(have, expected, atol=1e-5, rtol=0)
    assert graphed.stats.replays == 3 and graphed.stats.eager_total == 0


def test_adopting_takes_in_the_hooks_changed_meanwhile_and_keeps_the_others() -> None:
    net = model()
    baseline, gone = Doubler(), Doubler()
    net[0].register_forward_hook(baseline)
    gone_handle = net[1].register_forward_hook(gone)
    watch = HookWatch(net)
    users = net[0].register_forward_hook(Doubler())
    with watch.adopting():
        own = net[0].register_forward_hook(Doubler())
        gone_handle.remove()
    assert watch.differences() == ("0",)  # the user's hook, still there
    users.remove()
    assert watch.differences() == ()
    own.remove()
    assert watch.differences() == ("0",)
