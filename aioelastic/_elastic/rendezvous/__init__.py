"""One node's side of a rendezvous: torch's handlers created off the loop, a round joined
and ranks agreed, and a lost node forgotten at once.
"""
