"""The one virtual-environment builder: clean process environments, logged uv steps, stamped cached builds.

Environments are made by uv (`uv venv`, `uv pip install`; uv comes with the tools venv,
tools/requirements.txt): it resolves and downloads in parallel and hard-links every file from one
cache into every environment (`<cache>/uv`, the user cache's own, or UV_CACHE_DIR), so torch is
stored once however many environments hold it. uv reads no pip configuration: pip's PIP_FIND_LINKS,
PIP_INDEX_URL, PIP_EXTRA_INDEX_URL and PIP_NO_INDEX are given to it as its own options
(`index_options`), so a folder holding the CPU torch wheel works as it did with pip.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tools.fork.core.config import REPO_ROOT, cache_dir
from tools.fork.core.errors import EXIT_TOOLS_ENV, ForkError

# The environment every command in a built venv gets (and every test run).
RUN_ENV = {
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}
_STRIP_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV", "CONDA_PREFIX")


def say(msg: str) -> None:
    """A progress line of an environment build (the default voice: the test environment's)."""
    print(f"testenv: {msg}", flush=True)


def run_env(venv: Path | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The process environment for commands in a venv (or, with None, for plain tools): no PYTHONPATH, no cargo."""
    env = {k: v for k, v in os.environ.items() if k not in _STRIP_ENV}
    cargo = str(Path.home() / ".cargo" / "bin")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p.rstrip("/") != cargo]
    if venv is not None:
        path.insert(0, str(venv / "bin"))
        env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join(path)
    env.update(RUN_ENV)
    if extra:
        env.update(extra)
    return env


def uv() -> str:
    """The uv executable: this Python's (the `uv` package), else one on PATH, else the tools venv's
    (a test environment's Python, which runs the tooling's tests, has no uv of its own)."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        pass
    tools_venv = REPO_ROOT / "build" / "tools-venv" / "bin" / "uv"
    found = shutil.which("uv") or (str(tools_venv) if tools_venv.is_file() else None)
    if found:
        return found
    raise ForkError(
        "uv is missing: it builds the test environments. Use build/tools-venv/bin/python (made by `make`), "
        "or pip install -r tools/requirements.txt",
        EXIT_TOOLS_ENV,
    )


def uv_env(env: dict[str, str]) -> dict[str, str]:
    """`env` plus uv's cache: UV_CACHE_DIR when set, else `<cache>/uv` (beside the environments, so
    on their file system: uv hard-links from it)."""
    return {"UV_CACHE_DIR": str(cache_dir() / "uv"), **env}


def index_options(environ: dict[str, str] | None = None) -> list[str]:
    """pip's index variables as uv options (uv reads neither pip.conf nor PIP_*); a UV_* variable
    that is set already speaks for itself and is left to uv."""
    environ = os.environ if environ is None else environ
    opts: list[str] = []
    if environ.get("PIP_NO_INDEX", "").lower() in ("1", "true", "yes", "on") and "UV_NO_INDEX" not in environ:
        opts.append("--no-index")
    for pip_var, uv_var, option in (
        ("PIP_INDEX_URL", "UV_DEFAULT_INDEX", "--default-index"),
        ("PIP_EXTRA_INDEX_URL", "UV_INDEX", "--index"),
        ("PIP_FIND_LINKS", "UV_FIND_LINKS", "--find-links"),
    ):
        if uv_var not in environ:
            for value in environ.get(pip_var, "").split():
                opts += [option, value]
    return opts


def pip(venv: Path, command: str, *args: str) -> list[str]:
    """The argv of `pip COMMAND ARGS` for the venv, run by uv (`uv pip`)."""
    index = index_options() if command == "install" else []
    return [uv(), "pip", command, "--python", str(venv / "bin" / "python"), *index, *args]


def run_logged(cmd: list[str], *, env: dict[str, str], log: Path, what: str, say=say) -> float:
    """Run a build step, output to `log`; raise with the log's tail on failure."""
    t0 = time.monotonic()
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    dt = time.monotonic() - t0
    if proc.returncode != 0:
        raise ForkError(f"test env: {what} failed (exit {proc.returncode}): {step_error(log)}\n  whole output: {log}")
    say(f"  {what}: {dt:.1f} s")
    return dt


def step_error(log: Path) -> str:
    """The cause of a failed step in one line: the installer's own error lines of the step's output
    (its last command in `log`; pip's `ERROR: `, uv's `error: ` and `×`), else that output's last
    line; not a build's or a C++ trace's tail."""
    out = log.read_text(errors="replace").rsplit("\n$ ", 1)[-1].splitlines()[1:]
    lines = [ln.strip() for ln in out if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("ERROR: ", "error: ", "× "))]
    cause = " / ".join(errors[:2]) if errors else (lines[-1] if lines else "(no output)")
    return cause if len(cause) <= 400 else cause[:397] + "..."


def create(venv: Path, *, log: Path, seed: bool = False, say=say) -> None:
    """A new venv at `venv` (anything there before is removed) for this Python, made by uv; with
    `seed`, pip, setuptools and wheel in it."""
    if venv.exists():
        shutil.rmtree(venv)
    cmd = [uv(), "venv", "-q", "--python", sys.executable, *(["--seed"] if seed else []), str(venv)]
    run_logged(cmd, env=uv_env(run_env(None)), log=log, what="create venv", say=say)


def purelib(python: Path) -> Path:
    """The site-packages (where pure-Python packages go) of the interpreter `python`."""
    proc = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        env=run_env(None), capture_output=True, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if proc.returncode != 0:
        raise ForkError(
            f"{python}: asking for its purelib failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
        )
    return Path(proc.stdout.strip())


def recipe_hash(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Stamp:
    """`stamp.json`: the recipe hash a part was built from, written only after a full build."""

    path: Path

    def read(self) -> str | None:
        try:
            return json.loads(self.path.read_text())["hash"]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def matches(self, digest: str) -> bool:
        return self.read() == digest

    def write(self, digest: str, recipe: dict, seconds: float, extra: dict | None = None) -> None:
        data = {"hash": digest, "recipe": recipe, "build_seconds": round(seconds, 1), **(extra or {})}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


@contextmanager
def locked(path: Path, what: str, say=say):
    """Exclusive use of what `path` (a lock file) guards, across processes; says so when it waits.
    A flock (filelock's): the kernel releases it when its holder dies. Imported here: verbs that run
    on a plain Python (`check`) import this module without using it."""
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        say(f"waiting for another process using {what} ...")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextmanager
def installing(say=say):
    """One process at a time installs through uv's cache. uv shares no download or unpack in flight
    between processes: builds side by side (make test's prefetch) would each store their own copy of
    every wheel they have in common (1 GB of duplicates on a fresh machine); one after another, the
    later build hard-links what the earlier one stored."""
    cache = Path(uv_env(dict(os.environ))["UV_CACHE_DIR"])
    with locked(cache.with_name(cache.name + ".install.lock"), "uv's cache (installing)", say):
        yield


def build_part(
    root: Path, name: str, recipe: dict, content: str, build, *, rebuild: bool, note=None, say=say
) -> tuple[str, Path]:
    """Build `<root>/<name>-<hash16>/` once (under its lock); the stamp is written after a full build.

    `build(home, log)` makes `home/content`; an unchanged recipe with a complete build is a no-op.
    """
    digest = recipe_hash(recipe)
    home = root / f"{name}-{digest[:16]}"
    home.mkdir(parents=True, exist_ok=True)
    stamp = Stamp(home / "stamp.json")
    with locked(home / "lock", f"{home.name} (build)", say):
        if not rebuild and stamp.matches(digest) and (home / content).is_dir():
            say(f"{name}: up to date ({home})")
            return digest, home
        why = "forced" if rebuild else ("incomplete build" if (home / content).exists() else "not built yet")
        say(f"{name}: building ({why}) in {home}, log {home / 'build.log'}")
        if note:
            note()
        stamp.clear()
        log = home / "build.log"
        log.write_text("")
        t1 = time.monotonic()
        build(home, log)
        stamp.write(digest, recipe, time.monotonic() - t1)
        say(f"{name}: built in {time.monotonic() - t1:.1f} s")
    return digest, home


def ensure_spec(where: Path, spec: list[str], marker: str, say=say, then: tuple[tuple[str, ...], ...] = ()) -> Path:
    """A venv at `where` holding `spec` (pip requirements), then `then` run (pip argument lists), all
    recorded in `where/marker`: an unchanged record installs nothing again. Returns its Python. The
    log of its steps is `where/../<name>.log`."""
    python = where / "bin" / "python"
    stamp = where / marker
    record = spec if not then else {"spec": spec, "then": [list(t) for t in then]}

    def current() -> bool:
        return python.exists() and stamp.exists() and json.loads(stamp.read_text()) == record

    if current():
        return python
    where.parent.mkdir(parents=True, exist_ok=True)
    with locked(where.with_name(where.name + ".lock"), where.name, say):  # two `test` runs side by side
        if current():
            return python
        log = where.with_name(where.name + ".log")
        log.write_text("")
        if not python.exists():
            say(f"creating {where}")
            create(where, log=log, say=say)
        say(f"installing {' '.join(spec)} into {where}")
        env = uv_env(run_env(where))
        with installing(say):
            run_logged(pip(where, "install", "-q", *spec), env=env, log=log, what="pip install", say=say)
            for args in then:
                run_logged(pip(where, *args), env=env, log=log, what="pip " + " ".join(args), say=say)
        stamp.write_text(json.dumps(record))
    return python


def link(link: Path, target: Path) -> None:
    """Point `link` at `target` (a convenience: failures are ignored)."""
    try:
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.is_dir():
            shutil.rmtree(link)  # an old in-repo venv (before environments moved to the cache)
        link.symlink_to(target)
    except OSError:
        pass
