"""`npu-report`: the series' evidence on an NPU (or a GPU, or the CPU in a small mode) in one folder."""
