"""The follow family: each new vllm-ascend release becomes a tested branch `follow/<version>`, without a person.

The verb is cmd_follow (`python -m tools.fork follow`); releases asks the package registry what is
newer than the pin, report writes what happened (JSON for a scheduler, Markdown for a pull request).
The rebase itself is the rebase family's `rebase_tested` (tools/fork/rebase/engine.py).
"""
