"""Small shared helpers with no product knowledge: caches, heap tuning, stack dumps, atomic files, tracing."""
