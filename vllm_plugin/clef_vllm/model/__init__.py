"""The Clef-Flash model without vLLM: the joint head, its features and tables, checkpoint files and layouts,
and the builders of tiny and release-shaped checkpoints."""
