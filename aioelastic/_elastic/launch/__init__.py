"""``elastic_launch`` and ``LaunchConfig``: torch's launcher API on top of the agent."""
