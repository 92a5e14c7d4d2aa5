"""The HTTP server (FastAPI) and the clef-systemone console script."""
