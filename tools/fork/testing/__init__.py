"""The test verb (cmd_test) and what it runs: environments, upstream's CPU suite, the fork's own checks.

session (`run_tests`: the whole test run on one base, the function other verbs call), testenv,
venvs and base_recipe (each base's CPU test environment), suite, junit, results and exclusions
(running and comparing upstream's suite), steps (kernel, compile, tooling and deploy checks), bisect.
"""
