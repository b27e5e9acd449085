"""The harness: the command line, the driver processes, the run and its report.

It runs whatever :class:`~benchmarks.harness._spec.Measure` it is given and knows nothing
of any one measure: which systems a measure compares and how each side runs is declared in
:mod:`benchmarks.measures`.

Kept empty on purpose: ``benchmarks.cpu_split`` imports ``_run_dir`` into the process whose
CPU it measures, and must not import the rest of the harness with it.
"""
