"""What the agent tells the world: lifecycle events, their fan-out, the launcher's narrated
lines, Prometheus metrics and the health endpoint.
"""
