"""Startup-latency and supervision benchmarks: aioelastic against torch, in one run.

Run ``python -m benchmarks --help``. Every measure runs aioelastic and its torch
equivalent on the same workload, repetitions interleaved, each system in its own driver
process; workers record their own timestamps. See docs/benchmarks.md for what each
measure times and the README for the table of a full run.

Three rooms, each importing only from the ones before it (``tests/benchmarks`` checks):

- ``programs/``: the worker programs the supervisors under test start, and the protocol
  they share with their drivers (the clock and stamp files, the ready barrier);
- ``harness/``: the command line, the driver processes, the interleaved run, the report
  and plots; it runs any :class:`~benchmarks.harness._spec.Measure` and knows none;
- ``measures/``: what each measure compares and how each side runs, the systems that
  several of them share declared once (``measures/_systems.py``).

The commands sit beside them: ``python -m benchmarks`` (``__main__``: the harness over
every measure), ``python -m benchmarks.cpu_split`` and ``python -m benchmarks.resources``
(standalone figures). ``results/`` keeps the recorded runs.
"""
