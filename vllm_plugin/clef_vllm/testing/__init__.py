"""Test and demo helpers: tiny checkpoints in the release layout."""
