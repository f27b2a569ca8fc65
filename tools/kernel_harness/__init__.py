"""Run and check the series' Triton kernels without vLLM's engine (see README.md)."""
