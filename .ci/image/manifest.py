"""Every file of the installed vllm-ascend, with its sha256: taken in the stand-in image before the
deploy, checked after `deploy --revert` (.ci/image.sh). Standard library only; runs on the image's
Python (3.10+).

  python3 -I manifest.py take OUT.json   record the package of the vllm_ascend this Python imports
  python3 -I manifest.py check BASE.json compare with it now: exit 1 on any difference

Recorded: every file, link and directory under site-packages whose top-level name is
vllm_ascend's (the package, its dist-info, a deploy backup folder, an editable-install finder),
with type, mode, sha256 or link target; and the names of all top-level entries of site-packages,
so that anything left behind elsewhere shows too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import stat
import sys
from pathlib import Path


def _site() -> Path:
    spec = importlib.util.find_spec("vllm_ascend")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("manifest: this Python imports no vllm_ascend package")
    return Path(list(spec.submodule_search_locations)[0]).parent


def _ours(name: str) -> bool:
    return "vllm_ascend" in name.lower().replace("-", "_")


def _entry(path: Path) -> dict:
    st = path.lstat()
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return {"type": "link", "target": os.readlink(path)}
    if stat.S_ISDIR(st.st_mode):
        return {"type": "dir", "mode": oct(mode)}
    if stat.S_ISREG(st.st_mode):
        return {"type": "file", "mode": oct(mode), "size": st.st_size,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}  # fmt: skip
    return {"type": f"special {stat.S_IFMT(st.st_mode):o}"}


def take() -> dict:
    site = _site()
    files = {}
    for top in sorted(os.listdir(site)):
        if not _ours(top):
            continue
        root = site / top
        files[top] = _entry(root)
        if root.is_dir() and not root.is_symlink():
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                for name in sorted(dirnames + filenames):
                    p = Path(dirpath) / name
                    files[p.relative_to(site).as_posix()] = _entry(p)
    return {"site_packages": str(site), "top_level": sorted(os.listdir(site)), "files": files}


def _record_rows(site: Path, files: dict) -> set[str]:
    rows = set()
    for rel in files:
        if rel.endswith(".dist-info/RECORD"):
            for line in (site / rel).read_text().splitlines() if (site / rel).exists() else []:
                rows.add(line.split(",", 1)[0])
    return rows


def check(base: dict) -> int:
    now = take()
    site = Path(now["site_packages"])
    problems = []
    if now["site_packages"] != base["site_packages"]:
        problems.append(("site-packages", f"now {now['site_packages']}, was {base['site_packages']}"))
    for name in sorted(set(now["top_level"]) ^ set(base["top_level"])):
        where = "added" if name in now["top_level"] else "missing"
        problems.append((name, f"top-level entry of site-packages {where}"))
    old, new = base["files"], now["files"]
    for rel in sorted(set(old) | set(new)):
        if rel not in new:
            problems.append((rel, "missing"))
        elif rel not in old:
            problems.append((rel, "added"))
        elif old[rel] != new[rel]:
            keys = sorted(k for k in set(old[rel]) | set(new[rel]) if old[rel].get(k) != new[rel].get(k))
            diff = ", ".join(f"{k} {old[rel].get(k)} -> {new[rel].get(k)}" for k in keys)
            problems.append((rel, f"changed: {diff}"))
    if not problems:
        n = sum(1 for e in new.values() if e["type"] == "file")
        print(f"manifest: byte for byte as before the deploy: {n} files, {len(new) - n} dirs/links, "
              f"same top-level entries in {site}")  # fmt: skip
        return 0
    for rel, why in problems:
        print(f"manifest: MISMATCH {rel}: {why}")
    print(f"manifest: {len(problems)} difference(s) from the stand-in image before the deploy")
    recorded = _record_rows(Path(base["site_packages"]), old)
    pyc = [rel for rel, why in problems if rel.endswith(".pyc") and why == "missing" and rel in recorded]
    if pyc and len(pyc) == len([p for p in problems if not p[0].endswith("__pycache__")]):
        print("manifest: every difference is pip-compiled bytecode listed in RECORD that the revert did not "
              "restore (a known deploy --revert bug)")  # fmt: skip
    return 1


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("take", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "take":
        data = take()
        Path(argv[1]).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"manifest: {len(data['files'])} entries of vllm-ascend in {data['site_packages']} -> {argv[1]}")
        return 0
    return check(json.loads(Path(argv[1]).read_text()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
