"""Child programs used by the tests: one module per area (core, logs, spawn, agent, cli, ...).

Function workers must be importable by spawned interpreters, so they live here rather than
in test modules, and binaries are run as ``python -m tests.children.<area> <command>``.
"""
