"""The elastic layer's settings: one parser per node, rendezvous and agent value, and the
agent's frozen configuration built from them.
"""
