"""The elastic agent: what it runs (spec, workers, result), each worker's environment, one
attempt's watch, and the loop of attempts with its restart decisions.
"""
