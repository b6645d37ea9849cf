"""Tokenizer (and chat template) from the same source as the weights: a GGUF file or an HF folder."""

from __future__ import annotations

import os


def load_tokenizer(source: str):
    """A transformers fast tokenizer for `source`: a .gguf file or a Hugging Face model folder.

    Never touches a hub: a missing file is a FileNotFoundError naming the path.
    """
    from transformers import AutoTokenizer

    if not os.path.exists(source):
        raise FileNotFoundError(f"model source not found: {source}")
    if source.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(source)),
            gguf_file=os.path.basename(source),
            local_files_only=True,
        )
    return AutoTokenizer.from_pretrained(source, local_files_only=True)


def eos_token_ids(tokenizer) -> list[int]:
    """Every id that ends generation by default: the tokenizer's EOS plus the chat end token."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return sorted(ids)
