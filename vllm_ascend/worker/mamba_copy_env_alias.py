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
"""Fork-only deployment alias of the Mamba state copy switch.

Deployment images set ``GLM53_BATCH_MEMCPY=1`` to run Mamba state copies through
the raw pointer kernel; it means ``VLLM_ASCEND_MAMBA_COPY_BACKEND=triton``.

* ``GLM53_BATCH_MEMCPY`` unset or ``0``: no opinion, ``VLLM_ASCEND_MAMBA_COPY_BACKEND``
  decides alone.
* ``GLM53_BATCH_MEMCPY=1``: ``triton``, unless ``VLLM_ASCEND_MAMBA_COPY_BACKEND`` is set
  to something else: that combination is an error naming both, never a guess.
* Any other value of ``GLM53_BATCH_MEMCPY`` is an error naming it and its allowed values.
"""

import os
from collections.abc import Mapping

from vllm.logger import logger

ENV_NAME = "VLLM_ASCEND_MAMBA_COPY_BACKEND"
ALIAS_NAME = "GLM53_BATCH_MEMCPY"
ALIAS_BACKEND = "triton"


def mamba_copy_backend_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The backend the deployment alias selects, or ``None`` when it has no opinion."""
    environ = os.environ if environ is None else environ
    alias = environ.get(ALIAS_NAME)
    if alias is None or alias.strip() == "0":
        return None
    if alias.strip() != "1":
        raise ValueError(
            f"Unknown {ALIAS_NAME}={alias!r}; allowed values: 1 (means {ENV_NAME}={ALIAS_BACKEND}), "
            "0 or unset (no opinion)."
        )
    upstream = environ.get(ENV_NAME) or ""
    if upstream.strip() and upstream.strip().lower() != ALIAS_BACKEND:
        raise ValueError(
            f"Conflicting Mamba state copy settings: {ALIAS_NAME}=1 selects {ALIAS_BACKEND!r}, "
            f"but {ENV_NAME}={upstream!r} selects {upstream.strip().lower()!r}. Unset one of them or make them agree."
        )
    logger.info_once("%s=1: Mamba state copies use %s=%s.", ALIAS_NAME, ENV_NAME, ALIAS_BACKEND)
    return ALIAS_BACKEND
