"""Thread count: `threads_num` is honoured; 0 takes the cores idle right now."""

from __future__ import annotations

import numba
import psutil
import pytest
import torch
from ktlong.kernels import threads

import ktlong
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


def test_an_answer_gives_up_a_core_another_job_takes(monkeypatch):
    """threads_num 0: the idle cores are counted again every RETHREAD_TOKENS tokens of an
    answer, so a job that starts mid-answer takes a thread away (its spinning thread would
    share a core with the step's own), and a count set by the user stays."""
    from ktlong import engine

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 Numba threads")  # the point is 1 vs 2
    lm = load_model(hf_model("llama", qk_scale=4.0), device="CPU", dtype="float32")
    idle = [2.0]
    monkeypatch.setattr(kernels, "auto_threads", threads.auto_threads)  # conftest pins it
    monkeypatch.setattr(threads, "idle_cores", lambda interval=0.1: idle[0])
    monkeypatch.setattr(threads, "physical_cores", lambda: 2)
    for n, want in ((0, [2] * (engine.RETHREAD_TOKENS - 1) + [1] * 5), (2, [2] * 20)):
        idle[0] = 2.0
        s = Session(lm, settings(threads_num=n))
        s.prefill(list(range(5, 40)))
        seen = []
        for _ in s.generate(Sampling(max_new_tokens=len(want), temperature=0.0)):
            seen.append(numba.get_num_threads())
            idle[0] = 1.0  # another job starts after the first token
        assert seen == want and s.threads == want[-1]


_SPIN_PROBE = """
import os, sys, time
import numpy as np
if sys.argv[1] == "torch first":  # the kernels' OpenMP calls then run on torch's runtime
    import torch  # noqa: F401
from numba import njit, prange
import ktlong
from ktlong import kernels
@njit(parallel=True)
def region(a):
    for i in prange(a.shape[0]):
        a[i] += 1
a = np.zeros(2)
kernels.configure_threads(2)
region(a)
cpu, wall = time.process_time(), time.perf_counter()
for _ in range(300):
    region(a)
    t = time.perf_counter()
    while time.perf_counter() - t < 50e-6:  # the caller's own work between two regions
        pass
print((time.process_time() - cpu) / (time.perf_counter() - wall))
"""


@pytest.mark.parametrize("order", ["torch first", "kernels first"])
@pytest.mark.parametrize("user_spin, spins", [(None, True), ("0", False)])
def test_kernel_threads_spin_between_regions_unless_told_not_to(order, user_spin, spins):
    """With ktlong's spin count, the second thread stays awake through a 50 us gap between two
    parallel regions (the process uses ~2 CPUs), whichever OpenMP runtime loads first (torch's
    or Numba's own); with GOMP_SPINCOUNT=0 set by the user it sleeps (~1 CPU: the caller's own
    loop)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["NUMBA_NUM_THREADS"] = "2"  # two threads even on a one-core machine
    if user_spin is not None:
        env["GOMP_SPINCOUNT"] = user_spin
    out = subprocess.run([sys.executable, "-c", _SPIN_PROBE, order], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    cpus = float(out.stdout.split()[-1])
    assert (cpus > 1.5) if spins else (cpus < 1.3), cpus


_ENV_PROBE = """
import json, os, sys
import ktlong.kernels  # noqa: F401  (as a worker would: ktlong's settings, unless a peer's)
from ktlong.bench import peer_env
names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
if sys.argv[1] == "child":
    print(json.dumps({k: os.environ.get(k) for k in names}))
else:
    import subprocess
    env = peer_env() if sys.argv[1] == "peer" else None
    out = subprocess.run([sys.executable, __file__, "child"], env=env, capture_output=True,
                         text=True, check=True)
    print(out.stdout)
"""


@pytest.mark.parametrize("user", [{}, {"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_a_peer_runtime_runs_with_the_users_openmp_settings(tmp_path, user):
    """A benchmark's peer (llama.cpp) worker sees the user's OpenMP settings, not the ones ktlong
    sets for its kernels (a passive wait policy halved llama.cpp's speed on two threads), even
    though the worker imports ktlong; a ktlong worker keeps them."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KTLONG_OMP_SET", "KTLONG_PEER")}
    env.update(user)
    probe = tmp_path / "probe.py"
    probe.write_text(_ENV_PROBE)

    def child_env(kind):
        out = subprocess.run([sys.executable, str(probe), kind], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    assert child_env("peer") == {k: user.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    ours = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": ktlong.SPIN_COUNT}
    assert child_env("ktlong") == {**ours, **user}
