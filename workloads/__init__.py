"""Workloads that both the tests and the benchmarks run.

A printed figure and a test's bound then come from the same code. Not part of the
installed package: it is imported from the repository root (pytest's ``pythonpath``;
``python -m benchmarks`` runs from the root). Tests and benchmarks import from here,
never from each other.
"""
