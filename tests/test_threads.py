"""The thread count chosen from the idle cores is reviewed as a run goes (``core/threads.py``): after
a moment of someone else's work at the start it takes the cores back; when others keep cores busy it
gives them up, half the way at a time; a count the user fixed is never changed."""

import itertools

import pytest
import torch

import mha2gqa.core.threads as threads


@pytest.fixture
def machine(monkeypatch):
    """A 2-core machine whose looks ``(time, busy s, total s, own s)`` the test gives in turn."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    looks: list[tuple[float, float, float, float]] = []
    monkeypatch.setattr(threads, "_look", lambda: looks.pop(0))
    monkeypatch.setattr(threads, "_clock", lambda: looks[0][0] if looks else 1e9)  # the next look's time
    yield looks
    torch.set_num_threads(before)
    threads._chosen = None


def test_toward_goes_half_the_way_rounded_toward_the_target():
    assert [threads.toward(1, 2), threads.toward(2, 1), threads.toward(16, 1), threads.toward(1, 16)] == [2, 1, 8, 9]
    assert threads.toward(4, 4) == 4


def test_a_count_chosen_in_a_busy_moment_takes_the_idle_cores_back(machine, monkeypatch):
    monkeypatch.setattr(threads, "busy_cores", lambda seconds=0.1: 1.0)  # another command ran at the start
    machine.append((0.0, 0.0, 0.0, 0.0))
    assert threads.use_threads(None) == 1 and torch.get_num_threads() == 1
    machine.append((5.0, 10.0, 10.0, 10.0))
    threads.review()  # too soon: no look taken
    assert len(machine) == 1 and torch.get_num_threads() == 1
    machine[0] = (20.0, 20.0, 40.0, 20.0)  # 20 s on 2 cores: this process busy 20 s, nothing else
    threads.review()
    assert torch.get_num_threads() == 2
    machine.append((40.0, 60.0, 80.0, 20.0))  # then another process keeps one core busy (20 s of 20 s)
    threads.review()
    assert torch.get_num_threads() == 1


def test_a_count_the_user_fixed_is_never_reviewed(machine, monkeypatch):
    machine.extend([(0.0, 0.0, 0.0, 0.0), (20.0, 20.0, 40.0, 20.0)])
    assert threads.use_threads(1) == 1
    threads.review()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads.use_threads(None)
    threads.review()
    assert torch.get_num_threads() == 1 and len(machine) == 2  # the machine never looked at


STAT = """cpu  300 0 100 500 20 0 5 10 40 0
cpu0 250 0 90 40 10 0 5 5 40 0
cpu1 50 0 10 460 10 0 0 5 0 0
intr 12345 0 0
"""


def test_cpu_times_read_the_usable_cores_only_and_count_guest_time_once():
    """``/proc/stat`` by hand: cpu1 alone is 65 busy of 535 ticks (its 460 idle + 10 iowait idle); the
    whole machine is user..steal (guest's 40 are in user already)."""
    assert threads.cpu_times(STAT, {1}) == (535, 470)
    assert threads.cpu_times(STAT, {0, 1}) == (400 + 535, 50 + 470)
    assert threads.cpu_times(STAT, None) == (935, 520)
    assert threads.cpu_times(STAT, {0, 7}) == (935, 520)  # a CPU without its own line: the machine's


def test_work_pinned_to_cores_this_process_may_not_use_does_not_take_its_threads(monkeypatch):
    """Pinned to cpu1 (taskset), with another process keeping cpu0 busy: no core of its own is busy,
    so it keeps its one thread; on both cores it would give the busy one up."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    busy0 = itertools.cycle(["cpu  100 0 0 100 0 0 0 0\ncpu0 100 0 0 0 0 0 0 0\ncpu1 0 0 0 100 0 0 0 0\n",
                             "cpu  200 0 0 200 0 0 0 0\ncpu0 200 0 0 0 0 0 0 0\ncpu1 0 0 0 200 0 0 0 0\n"])  # fmt: skip
    monkeypatch.setattr(threads, "_stat", lambda cpus: threads.cpu_times(next(busy0), cpus))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {1}, raising=False)
    assert threads.busy_cores() == 0.0 and threads.default_threads() == 1
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert threads.busy_cores() == 1.0
