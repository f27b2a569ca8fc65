"""pytest plugin: run only the first N tests of each test file (`npu-report`'s small mode on the CPU).

    python -m pytest -p tools.fork.npu.first_tests --first-tests-per-file 2 FILES

Chosen from each session's own collection, so a tree whose tests are parametrized differently
(another kernel signature) still runs its own first N.
"""

from __future__ import annotations

from collections import Counter


def pytest_addoption(parser):
    parser.addoption("--first-tests-per-file", type=int, default=0, help="run the first N tests of each file (0: all)")


def pytest_collection_modifyitems(config, items):
    n = config.getoption("--first-tests-per-file")
    if not n:
        return
    seen: Counter = Counter()
    keep, drop = [], []
    for item in items:
        file = item.nodeid.split("::", 1)[0]
        seen[file] += 1
        (keep if seen[file] <= n else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
