"""The child's side: what runs inside a worker (bootstrap, script, stack hook, error file,
result pipe), a fork server (and the exit-status record it writes) and the watchdog process.
"""
