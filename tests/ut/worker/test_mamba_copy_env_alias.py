# SPDX-License-Identifier: Apache-2.0
"""GLM53_BATCH_MEMCPY (fork-only deployment alias) against VLLM_ASCEND_MAMBA_COPY_BACKEND, at start-up."""

import pytest
from vllm.v1.worker import mamba_utils

from tests.ut.patch.worker.test_patch_mamba_utils_overlap import bound

ALIAS, ENV = "GLM53_BATCH_MEMCPY", "VLLM_ASCEND_MAMBA_COPY_BACKEND"


def _env(alias, upstream):
    return {k: v for k, v in ((ALIAS, alias), (ENV, upstream)) if v is not None}


@pytest.mark.parametrize(
    ("alias", "upstream", "active"),
    [
        (None, None, "torch"),
        ("0", None, "torch"),
        ("0", "triton", "triton"),  # no opinion: the upstream name decides
        ("0", "memmove", "memmove"),
        ("1", None, "triton"),
        ("1", "", "triton"),
        ("1", " TRITON ", "triton"),
    ],
)
def test_alias_selects_the_raw_pointer_kernel(monkeypatch, alias, upstream, active):
    monkeypatch.delenv(ALIAS, raising=False)
    with bound(monkeypatch, env=_env(alias, upstream)) as module:  # start-up binds the copy path
        assert active == module._MAMBA_COPY_BACKEND
        assert (mamba_utils.collect_mamba_copy_meta is module._collect_mamba_copy_meta_npu) == (active == "torch")


@pytest.mark.parametrize(
    ("alias", "upstream", "message"),
    [
        ("2", None, "GLM53_BATCH_MEMCPY must be either '0' or '1', got '2'"),
        ("", None, "GLM53_BATCH_MEMCPY must be either '0' or '1', got ''"),
        ("true", "triton", "GLM53_BATCH_MEMCPY must be either '0' or '1', got 'true'"),
        ("1", "torch", "GLM53_BATCH_MEMCPY=1 selects 'triton', but VLLM_ASCEND_MAMBA_COPY_BACKEND selects 'torch'"),
        ("1", " Memmove", "but VLLM_ASCEND_MAMBA_COPY_BACKEND selects 'memmove'"),
    ],
)
def test_unknown_or_conflicting_values_stop_start_up(monkeypatch, alias, upstream, message):
    monkeypatch.delenv(ALIAS, raising=False)
    with pytest.raises(ValueError, match=message), bound(monkeypatch, env=_env(alias, upstream)):
        pass
