"""Sharded embedding store and its exchange schemes."""
