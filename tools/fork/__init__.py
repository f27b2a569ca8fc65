"""Tooling of the vllm-ascend fork: `python -m tools.fork VERB` (see `--help`)."""
