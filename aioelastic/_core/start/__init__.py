"""Processes: starting a worker's process (launchers, the fork server, the watchdog) and
seeing it exit.
"""
