"""The worker programs: what the supervisors under test start, and what those workers write.

Started in child processes by module path (``python -m benchmarks.programs._scale_mem``),
by file path (``_gloo.py``, ``_trivial.py``, ``_multinode_job.py``: training scripts run by
``torchrun`` / ``aioelastic-run``, importing nothing from the project), as ``python -S -c``
code (``_bin``), or as functions a fork server preloads and unpickles (``_fn_light``,
``_fn_torch``: their module names are in the measures' preload lists). Nothing here
imports the harness or the measures.
"""
