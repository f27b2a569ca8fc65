"""The patch-queue verbs: apply, check, export, status, pr and build, one `cmd_<verb>` module each.

wheel (the fork's wheel) and backend (the in-tree PEP 517 backend of pyproject.toml) serve build.
"""
