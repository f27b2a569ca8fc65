"""Check the series: it applies exactly, matches the overlay and follows upstream's conventions.

It applies to the pin with no fuzz or offset, the overlay matches it, re-exporting reproduces
`patches/` byte for byte, and every patch follows upstream's conventions (`[Module][Action] Title`,
the three PR body sections, `Signed-off-by:`).

Each problem is printed with the patch and file it concerns; the exit code is 1 if any.
`--all-bases` repeats the apply and overlay checks on every base in fork.toml (the support
matrix), each with its per-base variants (patches/bases/<version>/); `--test` also runs the
fork's tests (`python -m tools.fork test --base VERSION`) on each base checked.
"""

from __future__ import annotations

from pathlib import Path

from tools.fork.core import overlay, series, upstream
from tools.fork.core.config import ForkConfig
from tools.fork.core.errors import EXIT_FAILED, EXIT_OK
from tools.fork.core.materialize import ApplyFailed, materialize
from tools.fork.core.series import Patch, convention_problems, hunk_positions, render
from tools.fork.testing.session import RunOptions, run_tests

HELP = __doc__


def add_arguments(p) -> None:
    p.add_argument("--all-bases", action="store_true", help="also apply the series to every base in fork.toml")
    p.add_argument("--test", action="store_true", help="also run the fork's tests on every base checked")
    upstream.add_source_arguments(p)


def reproduce_problems(patches: list[Patch], rendered: list[tuple[str, bytes]]) -> list[str]:
    """Compare re-exported patches with the files: names a hunk that moved, or the first differing line."""
    problems = []
    got = dict(rendered)
    if [p.name for p in patches] != [name for name, _ in rendered]:
        problems.append(
            "re-export gives different patch names: "
            f"{[name for name, _ in rendered]} vs patches/series {[p.name for p in patches]}; run export"
        )
    for p in patches:
        new = got.get(p.name)
        if new is None or new == p.data:
            continue
        old_hunks, new_hunks = hunk_positions(p.data), hunk_positions(new)
        moved = [
            f"{f}: hunk @@ -{o},+{n} now applies at -{o2} (offset {o2 - o:+d} lines)"
            for (f, o, n), (_, o2, _) in zip(old_hunks, new_hunks)
            if o != o2
        ]
        if moved:
            problems += [f"patch {p.name}: applies with an offset, not exactly: {m}" for m in moved]
            continue
        old_lines, new_lines = p.data.splitlines(), new.splitlines()
        line = next(
            (i for i, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b), min(len(old_lines), len(new_lines))
        )
        problems.append(
            f"patch {p.name}: re-export differs at line {line + 1} "
            f"(file: {old_lines[line][:80] if line < len(old_lines) else b'<end>'!r}, "
            f"export: {new_lines[line][:80] if line < len(new_lines) else b'<end>'!r}); run export"
        )
    return problems


def overlay_problems(cfg: ForkConfig, tree: Path, version: str, patches: list[Patch]) -> list[str]:
    """Files the fork adds: the same bytes on every base as in the overlay, which holds each file as
    the whole series leaves it on the pin (later patches may change files earlier ones added). On
    another base, files of patches the pin does not apply (variant-only) and overlay files of pin
    patches that base skips (already upstream there) are not expected, and a file that one of that
    base's own versions of a patch adds or changes may differ (a test of what that release has)."""
    own = overlay.ownership(tree, version)
    variants = cfg.variants_dir(version)
    own_version = {i for i, p in enumerate(patches) if version != cfg.pin.version and p.path.parent == variants}
    name_of = {i: patches[i].name if i < len(patches) else own.commits[i][:12] for i in range(len(own.commits))}
    problems = []
    added = own.added_in_overlay()
    present = overlay.repo_files(cfg)
    if version != cfg.pin.version:
        applied_here = {p.name for p in patches}
        creator = {path: p.name for p in series.read(cfg) for path in series.created_files(p.data)}
        added = {path for path in added if path in creator or path in present}
        present = {path for path in present if creator.get(path) in applied_here}
    for path in sorted(added - present):
        problems.append(
            f"{path}: added by patch {name_of[own.created[path][0]]} but missing from the overlay; run export"
        )
    for path in sorted(present - added):
        problems.append(f"{path}: in the overlay but no patch adds it (upstream has it, or it was never exported)")
    for path in sorted(added & present):
        if own_version & {*own.created[path], *own.modified.get(path, [])}:
            continue
        if (cfg.root / path).read_bytes() != overlay.blob(tree, "HEAD", path):
            problems.append(f"{path}: overlay differs from patch {name_of[own.created[path][0]]}; run export")
    return problems


def series_file_problems(cfg: ForkConfig) -> list[str]:
    problems = []
    names = series.read_names(cfg)
    on_disk = {p.name for p in cfg.patches_dir.glob("*.patch")}
    for name in sorted(on_disk - set(names)):
        problems.append(f"patches/{name} is not listed in patches/series")
    numbers = [series.number(n) for n in names]
    for n in sorted({n for n in numbers if numbers.count(n) > 1}):
        same = ", ".join(x for x in names if series.number(x) == n)
        problems.append(f"patches/series: two or more patches are numbered {n}- ({same})")
    for name in cfg.fork_only:
        if name not in names:
            problems.append(f"fork.toml marks {name} fork-only, but patches/series does not list it")
    variants_root = cfg.patches_dir / "bases"
    if variants_root.is_dir():
        known = {b.version for b in cfg.bases}
        for d in sorted(variants_root.iterdir()):
            if d.name not in known:
                problems.append(f"patches/bases/{d.name}: not a base in fork.toml")
            for f in sorted(d.glob("*.patch")):
                if f.name not in names:
                    problems.append(f"patches/bases/{d.name}/{f.name}: variant of a patch not in patches/series")
    return problems


def _source_for(cfg: ForkConfig, version: str, args):
    """The base's source: a given --sdist/--checkout where it is that version (with --all-bases each
    base finds its own: the cache, a checkout remembered from an earlier --checkout, or the registry)."""
    sdist, checkout = getattr(args, "sdist", None), getattr(args, "checkout", None)
    unchecked = getattr(args, "version_unchecked", False)
    if getattr(args, "all_bases", False):
        if sdist is not None and sdist.is_file() and upstream.sdist_version(sdist) != version:
            sdist = None
        if checkout is not None and not unchecked and upstream.checkout_version(checkout)[0] != version:
            checkout = None
    return upstream.obtain(cfg, version, sdist=sdist, checkout=checkout, version_unchecked=unchecked).source


def check_base(cfg: ForkConfig, version: str, args) -> list[str]:
    try:
        patches = series.read(cfg, version)
    except Exception as exc:  # noqa: BLE001 - reported as a problem
        return [str(exc)]
    problems = [msg for p in patches for msg in convention_problems(p)]
    tree = cfg.build_dir / "check" / version
    try:
        materialize(
            tree.resolve(),
            lambda: _source_for(cfg, version, args),
            version,
            patches,
            force=True,
        )
    except ApplyFailed as exc:
        return problems + [str(exc)]
    if version == cfg.pin.version:
        # Only the pin must reproduce byte for byte; other bases may apply at an offset.
        problems += reproduce_problems(patches, render(tree, version))
    problems += overlay_problems(cfg, tree, version, patches)
    return problems


def run(args, cfg) -> int:
    problems = series_file_problems(cfg)
    versions = [b.version for b in cfg.bases] if args.all_bases else [cfg.pin.version]
    for version in versions:
        found = check_base(cfg, version, args)
        label = "pin" if version == cfg.pin.version else "base"
        n = len(series.read_names(cfg))
        status = "ok" if not found else f"{len(found)} problem(s)"
        print(f"fork check: {label} vllm-ascend {version}: {n} patch(es): {status}")
        problems += [f"[{version}] {msg}" for msg in found]
        if getattr(args, "test", False) and not found:
            print(f"fork check: running the fork's tests on {version}", flush=True)
            rc = run_tests(cfg, RunOptions(base=version))
            if rc:
                problems.append(f"[{version}] the fork's tests failed (exit {rc})")
    for msg in problems:
        print(f"  - {msg}")
    return EXIT_FAILED if problems else EXIT_OK
