"""Loaded by every Python subprocess whose PYTHONPATH includes this folder (CPU vLLM tests only)."""
import torchvision_stub  # noqa: F401
