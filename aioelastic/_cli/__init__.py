"""The command line's layer: torchrun's flags, their parser and the launch they describe.

``aioelastic.run`` is the entry point on top of it. Empty of imports on purpose.
"""
