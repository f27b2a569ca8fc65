"""The shared core every verb family builds on: config, errors, git, the series model, releases, trees.

config (fork.toml and the repository layout), errors (exit codes), git (every git call, with a fixed
identity), series (patches/series, patch files, variants, rendering), upstream (the one way to obtain
a release: `upstream.obtain`), registry (the package registry download behind it), safetar,
materialize (a release as a git repository with the series applied), overlay, forktoml, txn.
"""
