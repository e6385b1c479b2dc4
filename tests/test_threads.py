"""The thread count chosen from the idle cores is reviewed as a run goes (``core/threads.py``): after
a moment of someone else's work at the start it takes the cores back; when others keep cores busy it
gives them up, half the way at a time; a count the user fixed is never changed."""

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
