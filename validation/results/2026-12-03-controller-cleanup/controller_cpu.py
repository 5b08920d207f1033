"""`python controller_cpu.py PYTEST_ARGS`: pytest, then the CPU-seconds xdist's controller
spent and whether it imported torch."""

import resource
import sys

import pytest


class Controller:
    def pytest_sessionfinish(self, session):
        if not hasattr(session.config, "workerinput"):
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu = usage.ru_utime + usage.ru_stime
            print(f"\nCONTROLLER cpu_s={cpu:.2f} torch={'torch' in sys.modules}")


sys.exit(pytest.main(sys.argv[1:], plugins=[Controller()]))
