"""Output: a worker's streams into log files, the console, terminals and ``ctx.output()``;
which streams go where (`Std`), the supervisor's own console writers, log roots, and who
reads a terminal.
"""
