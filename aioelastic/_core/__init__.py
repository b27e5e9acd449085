"""The core layer: one group of worker processes, from checked arguments to teardown.

Checks, start (launcher threads, the fork server, the watchdog), the child side, exit
watch, logs and console, results and errors, the one teardown, hangs, and the state the
whole process shares. It imports no other layer of aioelastic.

Empty of imports on purpose: every worker imports this package on its way to
``_bootstrap``.
"""
