"""fork.toml on a Python with neither tomllib (3.10) nor tomli: tools/fork/minitoml.py reads the
TOML fork.toml uses exactly as tomllib does, and refuses the rest instead of misreading it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tools.fork import minitoml
from tools.fork.tests.conftest import REPO

tomllib = pytest.importorskip("tomllib")

SAMPLES = {
    "repository": (REPO / "fork.toml").read_text(),
    "synthetic": '[upstream]\ndist = "vllm-ascend"\nversion = "1.0.0"\nsha256 = "ab"\n\n'
    '[[bases]]\nversion = "1.0.0"\nsha256 = "ab"\n',
    "everything": textwrap.dedent(
        """\
        # comment
        top = 'literal \\n stays'   # trailing comment
        [upstream]
          dist = "vllm-ascend"  # indented
        "quoted key" = "esc \\" \\\\ \\t \\u00e9 # not a comment"
        n = -1_000
        on = true
        off = false
        list = ["a", 'b', ]
        empty = []
        [[bases]]
        version = "0.30.0rc2"
        [[bases]]
        version = "0.23.0.post1"
        [patches."0005-Misc-Feature-Honour-GLM53_BATCH_MEMCPY-1-as-a-deploy.patch"]
        fork_only = true
        reason = "deployment name"
        [patches]
        other = 1
        [bases.sub]
        x = 1
        """
    ),
}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_reads_what_tomllib_reads(name):
    assert minitoml.loads(SAMPLES[name]) == tomllib.loads(SAMPLES[name])


@pytest.mark.parametrize(
    "text",
    [
        'a = """multi\nline"""',
        "a = [\n1]",
        "a = {x = 1}",
        "a = 1.5",
        "a = 1979-05-27",
        'a.b = "dotted key"',
        'a = "unterminated',
        'a = "x" trailing',
        "a = 1\na = 2",
        "[t]\n[t]",
        'a = "bad \\q escape"',
        "[t",
        "= 1",
    ],
)
def test_refuses_what_it_does_not_read(text):
    with pytest.raises(minitoml.TOMLDecodeError, match="line"):
        minitoml.loads(text)


def test_the_tooling_loads_fork_toml_without_tomllib_and_tomli(tmp_path):
    """As on an image's Python 3.10 with no tomli: both imports fail, config.load still works."""
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(
            """\
            import sys
            class _Hide:
                def find_spec(self, name, path=None, target=None):
                    if name in ("tomllib", "tomli"):
                        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            sys.meta_path.insert(0, _Hide())
            """
        )
    )
    code = (
        "import sys; from tools.fork import config; "
        "assert config.tomllib.__name__ == 'tools.fork.minitoml', config.tomllib; "
        "cfg = config.load(); print(cfg.pin.version, len(cfg.bases), sorted(cfg.fork_only))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    from tools.fork import config

    cfg = config.load()
    assert proc.stdout.split()[0] == cfg.pin.version
    assert proc.stdout.split()[1] == str(len(cfg.bases))
