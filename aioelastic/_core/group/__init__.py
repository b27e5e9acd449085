"""The group: its arguments checked, its start prepared and made, what became of each
worker, and ``PContext``, which holds its lifecycle.
"""
