"""PEP 517 build backend of the repository: `pip wheel .` builds the forked vllm-ascend.

It materializes the pinned base plus the series (build/fork), then runs upstream's own
setuptools build there with the fork's version (see tools/fork/queue/wheel.py).
"""

from __future__ import annotations

import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

from setuptools import build_meta as _setuptools

from tools.fork.core import config
from tools.fork.queue import wheel


@contextmanager
def _in_materialized_tree():
    cfg = config.load()
    tree = wheel.materialized_pin(cfg)
    env, notes = wheel.build_environment(cfg)
    wheel.announce(notes)
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(tree)
    try:
        with warnings.catch_warnings():
            # Upstream's setup.py declares its licence as a classifier, which setuptools >= 77 flags as
            # deprecated at every build step: upstream's metadata, not ours to change in a build.
            warnings.filterwarnings("ignore", message="License classifiers are deprecated")
            yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def get_requires_for_build_wheel(config_settings=None):
    with _in_materialized_tree():
        return _setuptools.get_requires_for_build_wheel(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    metadata_directory = str(Path(metadata_directory).resolve())
    with _in_materialized_tree():
        return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    wheel_directory = str(Path(wheel_directory).resolve())
    with _in_materialized_tree():
        # setuptools reuses build/lib: a file a patch removed would linger in the wheel.
        shutil.rmtree("build", ignore_errors=True)
        return _setuptools.build_wheel(wheel_directory, config_settings)
