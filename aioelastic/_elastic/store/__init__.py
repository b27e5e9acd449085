"""The rendezvous store as the agent uses it: blocking store calls on a thread of their own,
and the store the workers of a round are given.
"""
