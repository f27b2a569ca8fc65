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
"""Helpers shared by the Mamba state copy tests in this folder."""

import contextlib

from vllm.v1.worker import mamba_utils

import vllm_ascend.patch.worker.patch_mamba_utils as patch_mamba_utils
from vllm_ascend.worker import mamba_state_copy as msc


@contextlib.contextmanager
def restored_bindings():
    """Undo every binding a test (or a reload of patch_mamba_utils) makes."""
    saved_vllm_module = dict(vars(mamba_utils))
    saved_create = vars(mamba_utils.MambaCopyBuffers)["create"]
    saved_patch_module = dict(vars(patch_mamba_utils))  # a reload re-executes into the same dict
    saved_backend = msc._active_backend
    try:
        yield
    finally:
        vars(mamba_utils).update(saved_vllm_module)
        mamba_utils.MambaCopyBuffers.create = saved_create
        vars(patch_mamba_utils).clear()
        vars(patch_mamba_utils).update(saved_patch_module)
        msc._active_backend = saved_backend
