"""The compatible layer: ``spawn`` and ``launch`` shaped like ``torch.multiprocessing``.

Also the old module paths of the error types (``_old_paths``). Empty of imports on purpose.
"""
