"""What every child process does first (spreeze/proc.py): subnormal floats flushed, in children and in a
serial run, and the caller's setting given back."""
import multiprocessing as mp

import pytest
import torch

from spreeze.proc import child_setup, flush_denormals, start_process, stop_process


def subnormals_flushed() -> bool:
    return float(torch.tensor([1e-40]) * 1.0) == 0.0


@pytest.fixture(autouse=True)
def flushing_supported():
    was = flush_denormals(False)
    supported = torch.set_flush_denormal(True)
    flush_denormals(was)
    if not supported:
        pytest.skip("this CPU has no flush-to-zero mode torch can set")


def report_flush(queue) -> None:
    child_setup(1)
    # a subnormal Adam moment, as a dead unit's gradient leaves it: flushed, the step writes zero there
    p = torch.zeros(4, requires_grad=True)
    p.grad = torch.zeros(4)
    opt = torch.optim.Adam([p], lr=1e-3, fused=True)
    opt.step()
    opt.state[p]["exp_avg"].fill_(2e-39)
    opt.step()
    queue.put((subnormals_flushed(), int((opt.state[p]["exp_avg"] != 0).sum())))


def test_flush_denormals_reports_the_previous_setting_and_switches_it():
    was = flush_denormals(False)
    try:
        assert not subnormals_flushed()
        assert flush_denormals(True) is False
        assert subnormals_flushed()
        assert flush_denormals(True) is True
        assert flush_denormals(False) is True
        assert not subnormals_flushed()
    finally:
        flush_denormals(was)


def test_a_child_process_flushes_subnormals_before_it_computes():
    queue = mp.get_context("spawn").Queue()
    process = start_process(report_flush, queue, name="spreeze-test-flush")
    try:
        flushed, nonzero_moments = queue.get(timeout=60)
    finally:
        stop_process(process, timeout_s=10)
    assert flushed and nonzero_moments == 0
