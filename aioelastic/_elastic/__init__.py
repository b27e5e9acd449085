"""The elastic layer: ``elastic_launch``, the agent, rendezvous, events and metrics.

Built on the core (one group per attempt). Empty of imports on purpose.
"""
