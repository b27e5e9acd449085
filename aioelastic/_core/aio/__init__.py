"""Async utilities the rest of the core builds on: which async library runs us, events that
cost nothing until awaited, teardown run to its end under asyncio's cancellation, the pace
of synchronous set-up per loop turn, our own epoll of worker descriptors, and scoped
signal handling.
"""
