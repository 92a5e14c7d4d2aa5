"""vLLM integration: the Clef-Flash model class and its in-worker pooler (imported only by vLLM)."""
