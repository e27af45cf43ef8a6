"""layergraph.timing on the CPU (wall-clock time): medians of waited calls, and calls timed in
turns, whose order rotates from round to round so that drift weighs on every callable alike."""

from __future__ import annotations

import time

import pytest
import torch

from layergraph.timing import interleaved_waited_ms, timed_call, waited_ms

CPU = torch.device("cpu")


def sleeper(seconds: float, log: list[str], name: str):
    """A callable that logs its name and sleeps ``seconds``."""

    def call() -> None:
        log.append(name)
        time.sleep(seconds)

    return call


def test_each_callable_gets_its_own_median_in_turns() -> None:
    log: list[str] = []
    fns = {"short": sleeper(0.002, log, "short"), "long": sleeper(0.006, log, "long")}
    times = interleaved_waited_ms(fns, device=CPU, rounds=3, iters=4)
    assert set(times) == {"short", "long"}
    assert 2.0 <= times["short"] < 4.5
    assert 6.0 <= times["long"] < 9.0
    assert times["long"] / times["short"] == pytest.approx(3, rel=0.4)
    assert waited_ms(fns["short"], device=CPU, warmup=0, iters=3) >= 2.0


def test_the_order_rotates_from_round_to_round_after_one_warm_up_call_each() -> None:
    log: list[str] = []
    fns = {name: sleeper(0, log, name) for name in "abc"}
    interleaved_waited_ms(fns, device=CPU, rounds=3, iters=2)
    rounds = ["aabbcc", "bbccaa", "ccaabb"]
    assert "".join(log) == "abc" + "".join(rounds)


def test_a_timed_call_returns_its_output_and_its_wall_time_off_the_gpu() -> None:
    def slow() -> str:
        time.sleep(0.02)
        return "answer"

    output, ms = timed_call(slow, device=CPU)
    assert output == "answer" and 20 <= ms < 1000
