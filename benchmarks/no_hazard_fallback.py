"""pytest plugin: the grouped Mamba state copy without its hazard fallback (every request grouped).

Shows that the oracle tests catch unsafe grouping (chains, one destination twice):

    pytest -p benchmarks.no_hazard_fallback tests/ut/worker/test_mamba_copy_groups.py   # must fail
"""

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def no_hazard_fallback(monkeypatch):
    from vllm_ascend.worker import mamba_copy_groups

    monkeypatch.setattr(mamba_copy_groups, "conflicting_pairs", lambda src, *args, **kw: np.zeros(len(src), dtype=bool))
