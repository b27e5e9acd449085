"""Output: a worker's streams into log files, the console, terminals and ``ctx.output()``."""
