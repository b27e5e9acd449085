"""A module that fails to import: used to test fork-server preload errors."""

raise ImportError("this module fails to import on purpose")
