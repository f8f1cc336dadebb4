"""The CPU kernels' thread count beside busy cores (csrc/threads.cc, kernels/cpu/common.py): the
rule, the live measurement under a process that keeps a core busy, the switch that turns it off,
and the torch engine step that follows it and restores torch's count."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from dualop.kernels.cpu.common import team_for_usage, team_size
from dualop.torch.threads import threads_beside_busy_cores

pytestmark = pytest.mark.usefixtures("cpu_kernels")

CORES = len(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(CORES < 2, reason="one allowed core: no thread to give up")


@pytest.mark.parametrize("requested, cores, others, team", [
    (2, 2, 0.0, 2),    # quiet: all requested
    (2, 2, 0.4, 2),    # a core busy less than half the time stays ours
    (2, 2, 0.6, 1),    # more than half: given up
    (2, 2, 2.0, 1),    # every core busy: still one thread
    (8, 16, 3.6, 8),   # enough free cores for the request
    (16, 16, 3.6, 12),
    (1, 2, 0.0, 1),
    (0, 2, 0.0, 1),    # never fewer than one
    (4, 2, -0.3, 2),   # accounting noise below zero counts as quiet; never more than the cores
    (4, 4, float("nan"), 4),
])
def test_the_rule_gives_up_the_cores_others_keep_busy(requested, cores, others, team):
    assert team_for_usage(requested, cores, others) == team


def _busy_sibling() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _settled_team(requested: int) -> int:
    """team_size after two full sampling windows (the sampler compares readings 100 ms apart)."""
    for _ in range(3):
        team_size(requested)
        time.sleep(0.25)
    return team_size(requested)


@needs_two_cores
def test_a_busy_sibling_process_takes_a_thread_away():
    sibling = _busy_sibling()
    try:
        time.sleep(0.2)
        assert _settled_team(CORES) <= CORES - 1
    finally:
        sibling.kill()
        sibling.wait()


@needs_two_cores
def test_the_switch_keeps_the_requested_count_beside_a_busy_core():
    code = ("import time\nfrom dualop.kernels.cpu.common import team_size\n"
            "for _ in range(4):\n    team_size(%d)\n    time.sleep(0.25)\nprint(team_size(%d))" % (CORES, CORES))
    sibling = _busy_sibling()
    try:
        env = dict(os.environ, DUALOP_CPU_ADAPTIVE_THREADS="0")
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    finally:
        sibling.kill()
        sibling.wait()
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == CORES


@needs_two_cores
def test_the_step_lowers_torchs_count_beside_a_busy_core_and_restores_it():
    configured = torch.get_num_threads()
    torch.set_num_threads(CORES)
    sibling = _busy_sibling()
    try:
        time.sleep(0.2)
        _settled_team(CORES)
        with threads_beside_busy_cores() as team:
            assert team <= CORES - 1
            assert torch.get_num_threads() == team
        assert torch.get_num_threads() == CORES
    finally:
        sibling.kill()
        sibling.wait()
        torch.set_num_threads(configured)
