"""fork.toml's rewrite on a rebase keeps every comment while the pin, bases and entries change.

The new pin and bases parse back, entries follow renames, and a base dropped at the end does not take
the next table's comment with it.
"""

from __future__ import annotations

from tools.fork.core import config
from tools.fork.core.config import tomllib
from tools.fork.core.forktoml import updated_fork_toml

OLD_PIN, OLD_BASE, NEW_PIN = ("0.2.0", "a" * 64), ("0.1.0", "b" * 64), ("0.3.0", "c" * 64)

FORK_TOML = f"""# The fork.

[upstream]
# The pinned base.
dist = "vllm-ascend"
version = "{OLD_PIN[0]}"
sha256 = "{OLD_PIN[1]}"

# Bases the series is kept green on.
[[bases]]
version = "{OLD_PIN[0]}"
sha256 = "{OLD_PIN[1]}"

[[bases]]
version = "{OLD_BASE[0]}"
sha256 = "{OLD_BASE[1]}"

# Patches that stay in the fork.
[patches."0002-Two.patch"]
fork_only = true
reason = "two"

[patches."0003-Three.patch"]
fork_only = true
reason = "three"
"""


def _comments(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.lstrip().startswith("#")]


def test_dropping_the_last_base_keeps_every_comment_and_the_entries_follow_their_patches(tmp_path):
    (tmp_path / "fork.toml").write_text(FORK_TOML)
    cfg = config.load(tmp_path)
    kept = [b for b in cfg.bases if b.version == OLD_PIN[0]]  # OLD_BASE, the last [[bases]], is dropped
    renamed = {"0003-Three.patch": "0002-Three.patch", "0002-Two.patch": "0001-Two.patch"}  # a chain

    text = updated_fork_toml(cfg, NEW_PIN[0], NEW_PIN[1], kept, renamed, removed=[])

    data = tomllib.loads(text)
    assert (data["upstream"]["version"], data["upstream"]["sha256"]) == NEW_PIN
    assert [(b["version"], b["sha256"]) for b in data["bases"]] == [OLD_PIN, NEW_PIN]
    assert {name: meta["reason"] for name, meta in data["patches"].items()} == {
        "0001-Two.patch": "two",
        "0002-Three.patch": "three",
    }
    assert _comments(text) == _comments(FORK_TOML)


def test_a_patch_that_left_the_series_loses_its_entry_and_nothing_else(tmp_path):
    (tmp_path / "fork.toml").write_text(FORK_TOML)
    cfg = config.load(tmp_path)

    text = updated_fork_toml(cfg, OLD_PIN[0], OLD_PIN[1], list(cfg.bases), {}, removed=["0002-Two.patch"])

    assert list(tomllib.loads(text)["patches"]) == ["0003-Three.patch"]
    assert _comments(text) == _comments(FORK_TOML)
    entry = '[patches."0002-Two.patch"]\nfork_only = true\nreason = "two"\n\n'
    assert text == FORK_TOML.replace(entry, "")
