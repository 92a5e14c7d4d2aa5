"""Helpers for tests and benchmarks: a live server in a subprocess (:mod:`.server`) and the real
Qwen3.5 tokenizer rebuilt offline (:mod:`.qwen_tokenizer`). Tiny checkpoints: :mod:`clef_vllm.model.tiny`."""
