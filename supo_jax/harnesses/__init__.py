"""Harnesses that run in environments of their own (docs/HARNESS.md)."""
