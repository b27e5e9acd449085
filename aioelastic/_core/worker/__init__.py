"""The worker record and its teardown."""
