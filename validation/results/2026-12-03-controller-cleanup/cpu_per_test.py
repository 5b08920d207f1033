"""pytest plugin: machine-wide busy CPU-seconds (/proc/stat) over each test's call phase."""
import os
import pytest


def _busy() -> float:
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = _busy()
    try:
        return (yield)
    finally:
        print(f"\nCPU {item.nodeid} {_busy() - before:.1f}")
