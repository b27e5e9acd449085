"""The elastic layer: ``elastic_launch``, the agent, rendezvous, the job channel, events.

Built on the core (one group per attempt), in rooms lowest first: ``observe`` (what the
agent tells the world), ``settings``, ``store``, ``channel``, ``rendezvous``, ``agent``,
``launch``. Empty of imports on purpose.
"""
