"""Thread count: `threads_num` is honoured; 0 takes the cores idle right now."""

from __future__ import annotations

import numba
import psutil
import pytest
import torch
from ktlong.kernels import threads

from ktlong import kernels
from ktlong.engine import Sampling, Session
from ktlong.model import load_model

from .models import hf_model, settings


@pytest.fixture(autouse=True)
def _restore_threads():
    yield
    kernels.configure_threads(0)


def test_idle_cores_counts_other_work_as_busy_and_own_work_as_free(monkeypatch):
    # (idle, total ticks of all CPUs, own CPU seconds); 100 ticks a second, 4 CPUs
    snaps = iter([(100, 1000, 0.0), (150, 1200, 0.0), (250, 1600, 1.0), (251, 1610, 1.0)])
    monkeypatch.setattr(threads, "_snapshot", lambda: next(snaps))
    monkeypatch.setattr(threads, "_prev", None)
    monkeypatch.setattr(threads, "_CLK_TCK", 100)
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    assert threads.idle_cores() == pytest.approx(1.0)  # first call samples: 50 of 200 idle
    # next call: since the last one, 100 of 400 ticks idle, and 100 ticks were this process's
    assert threads.idle_cores() == pytest.approx(4 * (100 + 100) / 400)
    # 10 ticks later (25 ms on 4 CPUs): too soon to measure, the last result stands
    assert threads.idle_cores() == pytest.approx(2.0)


def test_idle_cores_on_this_machine_is_within_the_usable_cores():
    assert 0.0 <= threads.idle_cores(0.05) <= threads.usable_cores()


@pytest.mark.parametrize("idle, want", [(0.2, 1), (1.0, 1), (1.6, 2), (64.0, None)])
def test_auto_threads_rounds_the_idle_cores(monkeypatch, idle, want):
    monkeypatch.setattr(threads, "idle_cores", lambda interval=0.1: idle)
    monkeypatch.setattr(threads, "physical_cores", lambda: 1)  # no floor above 1
    assert threads.auto_threads() == (want or threads.usable_cores())


@pytest.mark.parametrize("physical, usable, idle, want",
                         [(2, 2, 0.0, 1), (2, 2, 0.4, 1), (2, 2, 2.0, 2), (4, 4, 0.3, 3),
                          (8, 16, 1.0, 7), (8, 16, 12.0, 12), (1, 1, 0.0, 1)])
def test_auto_threads_never_below_physical_cores_less_one(monkeypatch, physical, usable, idle,
                                                          want):
    """Under load the idle-core probe can read near 0: the pick still keeps (physical - 1)."""
    monkeypatch.setattr(threads, "idle_cores", lambda interval=0.1: idle)
    monkeypatch.setattr(threads, "usable_cores", lambda: usable)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: usable if logical else physical)
    assert threads.physical_cores() == physical
    assert threads.auto_threads() == want


def test_physical_cores_is_within_the_usable_cores():
    assert 1 <= threads.physical_cores() <= threads.usable_cores()


def test_session_takes_idle_cores_unless_threads_num_is_set(monkeypatch):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 Numba threads")  # the point is 1 vs 2
    lm = load_model(hf_model("llama", qk_scale=4.0), device="CPU", dtype="float32")
    monkeypatch.setattr(kernels, "auto_threads", threads.auto_threads)  # conftest pins it
    monkeypatch.setattr(threads, "idle_cores", lambda interval=0.1: 1.0)  # one core busy
    monkeypatch.setattr(threads, "physical_cores", lambda: 2)  # a 2-core machine: floor 1
    s = Session(lm, settings(threads_num=0))
    s.prefill(list(range(5, 40)))
    assert s.threads == 1 and s.stats.threads == 1
    assert torch.get_num_threads() == 1 and numba.get_num_threads() == 1
    steps = list(s.generate(Sampling(max_new_tokens=2)))
    assert steps[-1].stats.threads == 1
    pinned = Session(lm, settings(threads_num=2))
    pinned.prefill(list(range(5, 40)))
    assert pinned.threads == 2 and torch.get_num_threads() == 2
    # an explicit count is kept even below the automatic floor (physical cores less one)
    monkeypatch.setattr(threads, "physical_cores", lambda: 3)
    monkeypatch.setattr(threads, "idle_cores", lambda interval=0.1: 0.0)
    assert threads.auto_threads() == 2
    one = Session(lm, settings(threads_num=1))
    one.prefill(list(range(5, 40)))
    assert one.threads == 1 and torch.get_num_threads() == 1
