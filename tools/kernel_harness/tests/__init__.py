"""The kernel harness's own tests: the loader, and the Ascend compile check on known-good and known-bad kernels."""
