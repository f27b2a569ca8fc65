#!/bin/sh
# Deploy the fork into the vllm_ascend that PYTHON imports, then verify it by content hash.
# docker/Dockerfile.deploy runs this in the image; tools/fork/deploy/check.py (the CI test) runs
# it against a real pip-installed vllm-ascend: the image build and the test run the same commands.
#
#   usage: docker/deploy-installed.sh [PYTHON [DEPLOY OPTIONS]]
#     PYTHON           the interpreter that serves (default python3); 3.10 or newer, any patch level
#     DEPLOY OPTIONS   passed to `deploy --to` and `deploy --verify`: --base VERSION, --sdist FILE
#     FORK_REPO=DIR    the fork repository whose series is deployed (default: the one holding this script)
set -eu
PYTHON="${1:-python3}"
[ $# -gt 0 ] && shift
cd "$(dirname "$0")/.."
# -I: never the fork repository's own vllm_ascend/ (the files the fork adds) from the working directory.
PKG="$("$PYTHON" -I -c 'import importlib.util as u; print(u.find_spec("vllm_ascend").submodule_search_locations[0])')"
echo "deploy-installed: $PYTHON imports vllm_ascend from $PKG"
"$PYTHON" -m tools.fork ${FORK_REPO:+-C "$FORK_REPO"} deploy --to "$PKG" "$@"
"$PYTHON" -m tools.fork ${FORK_REPO:+-C "$FORK_REPO"} deploy --verify "$PKG" "$@"
