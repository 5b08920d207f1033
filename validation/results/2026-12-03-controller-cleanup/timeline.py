"""pytest plugin: appends (worker, start, end, test) per test to timeline.tsv."""

import os
import time

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.time()
    try:
        return (yield)
    finally:
        with open("timeline.tsv", "a") as out:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
            out.write(f"{worker}\t{start:.2f}\t{time.time():.2f}\t{item.nodeid}\n")
