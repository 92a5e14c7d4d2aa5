"""The offline tools that build and check checkpoints, one module each (logic + command line).

Each has a console script (``clef-build-data``, ``clef-quantize-mixed``, ``clef-shrink-tables``,
``clef-load``, ``clef-sensitivity-scan``) and a ``scripts/<name>.py`` shell that calls its
``main``. ``clef-quantize-mixed`` runs in the llm-compressor venv, where clef-vllm is installed
without its dependencies: :mod:`clef_vllm.tools.quantize_mixed` and what it imports never import
vLLM or the server.
"""
