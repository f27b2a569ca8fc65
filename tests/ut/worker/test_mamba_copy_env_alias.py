#
# Copyright (c) 2026 Huawei Technologies Co., Ltd. All Rights Reserved.
# This file is a part of the vllm-ascend project.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
"""GLM53_BATCH_MEMCPY (fork-only deployment alias) against VLLM_ASCEND_MAMBA_COPY_BACKEND."""

import pytest
from vllm.v1.worker import mamba_utils

from tests.ut.patch.worker.test_patch_mamba_utils_overlap import bound
from vllm_ascend.worker.mamba_copy_env_alias import ALIAS_NAME, ENV_NAME, mamba_copy_backend_from_env


def _env(alias, upstream):
    env = {}
    if alias is not None:
        env[ALIAS_NAME] = alias
    if upstream is not None:
        env[ENV_NAME] = upstream
    return env


@pytest.mark.parametrize(
    ("alias", "upstream", "alias_says", "active"),
    [
        (None, None, None, "torch"),
        ("0", None, None, "torch"),
        ("0", "triton", None, "triton"),  # no opinion: the upstream-style name decides
        (None, "triton", None, "triton"),
        ("1", None, "triton", "triton"),
        ("1", "", "triton", "triton"),
        ("1", "triton", "triton", "triton"),
        (" 1 ", " TRITON ", "triton", "triton"),
    ],
)
def test_alias_selects_the_raw_pointer_kernel(monkeypatch, alias, upstream, alias_says, active):
    env = _env(alias, upstream)
    assert mamba_copy_backend_from_env(env) == alias_says
    monkeypatch.delenv(ALIAS_NAME, raising=False)
    with bound(monkeypatch, env=env) as module:  # start-up: the patch module binds the copy path
        assert active == module._MAMBA_COPY_BACKEND
        torch_path = mamba_utils.do_mamba_copy_block is module._do_mamba_copy_block_torch
        assert torch_path == (active == "torch")


@pytest.mark.parametrize("alias", ["2", "true", "yes", "", "01", "triton"])
def test_unknown_alias_value_fails_naming_it_and_its_allowed_values(alias):
    with pytest.raises(ValueError) as err:
        mamba_copy_backend_from_env(_env(alias, None))
    message = str(err.value)
    assert f"{ALIAS_NAME}={alias!r}" in message
    assert "allowed values: 1" in message and "0 or unset" in message


@pytest.mark.parametrize("upstream", ["torch", " Torch ", "bogus"])
def test_conflicting_settings_fail_naming_both(upstream):
    with pytest.raises(ValueError) as err:
        mamba_copy_backend_from_env(_env("1", upstream))
    message = str(err.value)
    assert f"{ALIAS_NAME}=1 selects 'triton'" in message
    assert f"{ENV_NAME}={upstream!r} selects {upstream.strip().lower()!r}" in message


@pytest.mark.parametrize(("alias", "upstream", "match"), [("1", "torch", "Conflicting"), ("on", None, ALIAS_NAME)])
def test_bad_combination_fails_at_start_up(monkeypatch, alias, upstream, match):
    monkeypatch.delenv(ALIAS_NAME, raising=False)
    with pytest.raises(ValueError, match=match), bound(monkeypatch, env=_env(alias, upstream)):
        pass
