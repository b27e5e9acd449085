"""The job channel: what the nodes of one rendezvous round tell each other through its store
(end tickets, liveness, stack gathering) and the job-wide stack report.
"""
