"""Reports: how a worker failed and how a group ended (``ProcessFailure``,
``ChildFailedError``, ``RunProcsResult``), and the worker-side ``record``.
"""
