"""The package's version (read by the build and written into repacked checkpoints' markers)."""

__version__ = "0.1.0"
