"""The process and its values: Linux primitives and their fallbacks, how a process exited
in words, the state the whole process shares, the subreaper, and one parser per
configuration value.
"""
