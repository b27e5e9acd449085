"""Startup-latency and supervision benchmarks: aioelastic against torch, in one run.

Run ``python -m benchmarks --help``. Every measure runs aioelastic and its torch
equivalent on the same workload, repetitions interleaved, each system in its own driver
process; workers record their own timestamps. See ``benchmarks/README`` in the project
README for the table of a full run.
"""
