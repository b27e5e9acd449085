"""The core layer: one group of worker processes, from checked arguments to teardown.

Its rooms, one sub-package each, lowest first: ``process`` (the process and its values),
``child`` (what runs in the child), ``reports``, ``start`` (processes: start and exit),
``output``, ``worker`` (the worker record and its teardown), ``hangs``, ``group``. A module
imports only from its own room or a lower one (tests/package/test_layers.py). It imports no other
layer of aioelastic.

Empty of imports on purpose, as each room's package is: every worker imports this package
on its way to ``child._bootstrap``.
"""
