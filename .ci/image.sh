#!/bin/bash
# CI step: build docker/Dockerfile.deploy in a real container engine (podman), on a stand-in of an
# upstream vllm-ascend image of the PINNED release, then verify, revert and compare it inside.
#
#   1. podman and debootstrap: installed with apt-get when missing (needs root).
#   2. Stand-in base image (cached): Debian bookworm minbase rootfs (debootstrap, mirror taken from
#      this machine's apt sources), `podman import`; then .ci/image/standin.Containerfile: a venv
#      with vllm-ascend==<pin> pip-installed from its sha256-verified sdist, and a manifest of the
#      installed package (every file, sha256). Tagged by pin + recipe hash; reused while both hold.
#   3. `podman build --isolation chroot -f docker/Dockerfile.deploy .` on top of it (the README
#      command), offline: the sdist is put into .fork-cache/sdists/ of the context.
#   4. .ci/image/test.Containerfile FROM the result: deploy --verify, deploy --revert, the package
#      byte for byte as in the stand-in before the deploy, deploy --verify fails afterwards.
# Nothing runs in `podman run` (it fails in this sandbox on rlimits); every check is a build step.
# If the engine cannot run, this step fails loudly: there is no skip.
#
#   usage: .ci/image.sh            environment: PYTHON (default build/tools-venv/bin/python, else python3)
#          FORK_IMAGE_PIP_COMPILE=0  the stand-in's pip writes no bytecode at install (default 1: it
#              compiles, listed in RECORD, as a wheel install into an image does; the revert must give
#              those .pyc files back too).
#          FORK_IMAGE_KEEP=1         keep the test stage's image (default: removed)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

T0=$SECONDS
step_start=$SECONDS
say() { printf 'image: %s\n' "$*"; }
lap() { say "$1 ($((SECONDS - step_start)) s)"; step_start=$SECONDS; }
die() {
    {
        printf '\n%s\n' "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
        printf 'image: FAILED: %s\n' "$*"
        printf 'image: CI fails: the deploy image was not built, or did not pass its test, in a container engine.\n'
        printf '%s\n\n' "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
    } >&2
    exit 1
}
trap 'die "command failed (line $LINENO): $BASH_COMMAND"' ERR

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
    if [ -x build/tools-venv/bin/python ]; then PYTHON=build/tools-venv/bin/python; else PYTHON=python3; fi
fi

# --- 1. the engine -------------------------------------------------------------------------------
need=()
command -v podman >/dev/null || need+=(podman)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "need ${need[*]}, and installing them needs root (apt-get install -y ${need[*]})"
    command -v apt-get >/dev/null || die "need ${need[*]} and there is no apt-get to install them"
    say "installing ${need[*]} (apt-get) ..."
    apt-get update -q >/dev/null || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null || die "apt-get install ${need[*]} failed"
    lap "installed ${need[*]}"
fi
info_err="$(podman info 2>&1 >/dev/null)" || die "podman cannot run here: ${info_err}"
say "$(podman --version), storage $(podman info --format '{{.Store.GraphDriverName}}' 2>/dev/null || echo '?')"
BUILD=(podman build --isolation chroot --pull=never)

# --- the pin, its verified sdist -----------------------------------------------------------------
read -r PIN SDIST_PATH < <("$PYTHON" -c '
from tools.fork.core import config
from tools.fork.core import upstream
cfg = config.load()
print(cfg.pin.version, upstream.obtain(cfg).source.sdist)') || die "could not get the pinned sdist"
SDIST="$(basename "$SDIST_PATH")"
say "pin: vllm-ascend $PIN ($SDIST_PATH)"

CACHE="${FORK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-ascend-fork}/image"
mkdir -p "$CACHE"
PREFIX=localhost/vllm-ascend-fork-ci

# --- 2a. the Debian rootfs (debootstrap), imported as an image --------------------------------------
SUITE=bookworm
INCLUDE=python3,python3-pip,python3-venv,git,ca-certificates
ROOTFS_KEY="$(printf '%s|minbase|%s' "$SUITE" "$INCLUDE" | sha256sum | cut -c1-12)"
ROOTFS_IMAGE="$PREFIX/$SUITE-minbase:$ROOTFS_KEY"
ROOTFS_TAR="$CACHE/rootfs-$SUITE-minbase-$ROOTFS_KEY.tar"

apt_mirror() {  # the first Debian archive URI this machine's apt uses for $SUITE (none: debootstrap's default)
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk -v suite="$SUITE" '
            /^[[:space:]]*$/ { if (uri != "" && ok) { print uri; exit } uri = ""; ok = 0; next }
            tolower($1) == "uris:" { uri = $2 }
            tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i == suite) ok = 1 }
            END { if (uri != "" && ok) print uri }' "$f" | head -n1
    done
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
        awk -v suite="$SUITE" '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i ~ /:\/\//) { if ($(i+1) == suite) print $i; break } }'
    return 0
}

if podman image exists "$ROOTFS_IMAGE"; then
    say "rootfs image $ROOTFS_IMAGE: cached"
else
    if [ ! -s "$ROOTFS_TAR" ]; then
        MIRROR="$( (set +o pipefail; apt_mirror | head -n1) )"
        say "debootstrap --variant=minbase --include=$INCLUDE $SUITE (mirror: ${MIRROR:-debootstrap default, none in apt sources}) ..."
        tmp_root="$(mktemp -d "$CACHE/.rootfs-XXXXXX")"
        trap 'rm -rf "$tmp_root"; die "command failed (line $LINENO): $BASH_COMMAND"' ERR
        debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$tmp_root" ${MIRROR:+"$MIRROR"} \
            >"$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log" >&2; rm -rf "$tmp_root"; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
        rm -rf "$tmp_root"/var/cache/apt/archives/*.deb "$tmp_root"/var/lib/apt/lists/*
        tar --numeric-owner -C "$tmp_root" -cf "$ROOTFS_TAR.part" .
        mv "$ROOTFS_TAR.part" "$ROOTFS_TAR"
        rm -rf "$tmp_root"
        trap 'die "command failed (line $LINENO): $BASH_COMMAND"' ERR
        lap "debootstrap done, rootfs cached in $ROOTFS_TAR"
    fi
    podman import -q "$ROOTFS_TAR" "$ROOTFS_IMAGE" >/dev/null || die "podman import of $ROOTFS_TAR failed"
    lap "imported $ROOTFS_IMAGE"
fi

# --- 2b. the stand-in: vllm-ascend==PIN installed from its sdist ----------------------------------
COMPILE=--compile
[ "${FORK_IMAGE_PIP_COMPILE:-1}" = 0 ] && COMPILE=--no-compile
RECIPE_KEY="$( { cat .ci/image/standin.Containerfile .ci/image/manifest.py; echo "$ROOTFS_IMAGE $PIN $COMPILE"; sha256sum "$SDIST_PATH" | cut -d' ' -f1; } | sha256sum | cut -c1-12)"
STANDIN="$PREFIX/standin:$PIN-$RECIPE_KEY"
if podman image exists "$STANDIN"; then
    say "stand-in $STANDIN: cached"
else
    ctx="$(mktemp -d)"
    CA=/etc/ssl/certs/ca-certificates.crt
    [ -s "$CA" ] || die "no CA bundle at $CA"
    cp "$CA" "$ctx/ca-certificates.crt"
    cp .ci/image/manifest.py "$ctx/"
    cp "$SDIST_PATH" "$ctx/$SDIST"
    # The pip configuration this machine reaches the package registry with: its http(s) index
    # URLs, trusted hosts, proxy and timeouts (local file:// indexes and paths stay behind).
    "$PYTHON" - >"$ctx/pip.conf" <<'PY' || die "could not read this machine's pip configuration"
import subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
keep = {"index-url", "extra-index-url", "trusted-host", "proxy", "timeout", "default-timeout", "retries"}
conf = {}
for line in out.splitlines():
    key, _, value = line.partition("=")
    name = key.rsplit(".", 1)[-1].replace("default-timeout", "timeout")
    if name in keep:
        words = [w for w in value.strip().strip("'\"").split() if not w.startswith(("file:", "/"))]
        if words:
            conf[name] = " ".join(words)
print("[global]\ncert = /etc/ssl/certs/ca-certificates.crt")
for k, v in sorted(conf.items()):
    print(f"{k} = {v}")
PY
    say "building the stand-in $STANDIN (vllm-ascend $PIN from its sdist, pip $COMPILE) ..."
    "${BUILD[@]}" -q --layers=false -f "$ROOT/.ci/image/standin.Containerfile" \
        --build-arg BASE="$ROOTFS_IMAGE" --build-arg STANDIN_SDIST="$SDIST" --build-arg STANDIN_VERSION="$PIN" \
        --build-arg STANDIN_PIP_COMPILE="$COMPILE" -t "$STANDIN" "$ctx" >/dev/null ||
        { rm -rf "$ctx"; die "building the stand-in image failed"; }
    rm -rf "$ctx"
    for stale in $(podman images --format '{{.Repository}}:{{.Tag}}' "$PREFIX/standin" | grep -F ":$PIN-" | grep -vxF "$STANDIN"); do
        podman rmi "$stale" >/dev/null 2>&1 || true  # an older recipe of this pin
    done
    lap "built the stand-in $STANDIN"
fi

# --- 3. docker/Dockerfile.deploy on the stand-in (the README command), offline ---------------------
mkdir -p .fork-cache/sdists
cmp -s "$SDIST_PATH" ".fork-cache/sdists/$SDIST" || cp "$SDIST_PATH" ".fork-cache/sdists/$SDIST"
DEPLOY="$PREFIX/deploy:$PIN"
old_deploy="$(podman image inspect --format '{{.Id}}' "$DEPLOY" 2>/dev/null || true)"
say "podman build -f docker/Dockerfile.deploy --build-arg VLLM_ASCEND_IMAGE=$STANDIN --build-arg FORK_DEPLOY_OPTIONS=\"--base $PIN\" ..."
"${BUILD[@]}" --no-cache --layers=false -f docker/Dockerfile.deploy \
    --build-arg VLLM_ASCEND_IMAGE="$STANDIN" --build-arg FORK_DEPLOY_OPTIONS="--base $PIN" \
    -t "$DEPLOY" . || die "podman build -f docker/Dockerfile.deploy failed"
new_deploy="$(podman image inspect --format '{{.Id}}' "$DEPLOY")"
[ -z "$old_deploy" ] || [ "$old_deploy" = "$new_deploy" ] || podman rmi -f "$old_deploy" >/dev/null 2>&1 || true
lap "built $DEPLOY"

# --- 4. the test stage: verify, revert, byte for byte ---------------------------------------------
TEST="$PREFIX/deploy-test:$PIN"
"${BUILD[@]}" --no-cache --layers=false -f .ci/image/test.Containerfile --build-arg DEPLOY_IMAGE="$DEPLOY" -t "$TEST" . ||
    die "the test stage FROM $DEPLOY failed (deploy --verify, deploy --revert or the byte-for-byte check)"
[ "${FORK_IMAGE_KEEP:-0}" = 1 ] || podman rmi -f "$TEST" >/dev/null 2>&1 || true
lap "test stage passed"

say "OK: docker/Dockerfile.deploy built on a stand-in of vllm-ascend $PIN, verified, reverted byte for byte ($((SECONDS - T0)) s)"
