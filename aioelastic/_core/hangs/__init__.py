"""Hangs: stacks on demand, the file timer, stall detection."""
