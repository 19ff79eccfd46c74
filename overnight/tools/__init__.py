"""Operator tools over a configured or running engine: `overnight budget` and `overnight check`."""
