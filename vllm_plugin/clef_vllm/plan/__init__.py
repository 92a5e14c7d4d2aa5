"""The GPU memory plan: what a checkpoint and the server's features take of a budget (pure arithmetic)."""
