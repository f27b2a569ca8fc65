"""The deploy verb (cmd_deploy): the fork into an installed vllm-ascend or a checkout, verified, reverted.

target (what is deployed into), expected (the files the fork must leave), package and checkout (the
two kinds of target), dist_record (pip's RECORD), check (the real end-to-end check the test verb runs).
"""
