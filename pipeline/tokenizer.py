"""Tokenizer (and chat template) from the same source as the weights: a GGUF file or an HF folder."""

from __future__ import annotations

import logging
import os

from pipeline import file_cache

log = logging.getLogger(__name__)


def load_tokenizer(source: str):
    """From a .gguf file or a Hugging Face folder; never touches a hub."""
    from transformers import AutoTokenizer

    if not os.path.exists(source):
        raise FileNotFoundError(f"model source not found: {source}")
    if not source.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    cached = file_cache.entry_path("tokenizer", source, _versions())
    if cached is not None and os.path.isdir(cached):
        try:
            return AutoTokenizer.from_pretrained(cached, local_files_only=True)
        except (OSError, ValueError) as e:
            log.warning("specrelay cache: unreadable tokenizer entry %s (%s)", cached, e)
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(source)),
        gguf_file=os.path.basename(source),
        local_files_only=True,
    )
    if cached is not None and not os.path.isdir(cached):
        file_cache.publish(cached, tokenizer.save_pretrained)
    return tokenizer


def _versions() -> list[str]:
    import tokenizers
    import transformers

    return [transformers.__version__, tokenizers.__version__]


def eos_token_ids(tokenizer) -> list[int]:
    """The tokenizer's EOS plus the chat end token."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return sorted(ids)
