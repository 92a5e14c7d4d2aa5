"""What runs inside vLLM's worker process: the Clef-Flash model class and its pooler.

Named ``worker`` (not ``vllm``) so it is never confused with the vLLM package itself; only vLLM
imports it (through the architecture registered by :func:`clef_vllm.plugin.register`).
"""
