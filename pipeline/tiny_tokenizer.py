"""A tokenizer for the tiny test models, no files: id i >= 3 is chr(i), ids 0-2 are <pad>, <s>,
</s>. The subset of the Hugging Face API the output path uses."""

from __future__ import annotations

from collections.abc import Iterable

SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>"}
VOCAB = 256


class ByteTokenizer:
    def __init__(self, eos_token_ids: Iterable[int] = (2,)) -> None:
        eos = list(eos_token_ids)
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = 1
        self.pad_token_id = 0
        self.unk_token_id = None
        self.all_special_ids = sorted(SPECIAL)
        self.all_special_tokens = [SPECIAL[i] for i in self.all_special_ids]
        self.vocab_size = VOCAB
        self.chat_template = None

    def __len__(self) -> int:
        return VOCAB

    def convert_ids_to_tokens(self, ids: int | Iterable[int],
                              skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int):
            return SPECIAL.get(ids, chr(ids))
        return [SPECIAL.get(i, chr(i)) for i in ids
                if not (skip_special_tokens and i in SPECIAL)]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | list[int]:
        inverse = {v: k for k, v in SPECIAL.items()}
        if isinstance(tokens, str):
            return inverse.get(tokens, ord(tokens[0]) if len(tokens) == 1 else -1)
        return [self.convert_tokens_to_ids(t) for t in tokens]  # type: ignore[misc]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False, **_: object) -> str:
        return "".join(SPECIAL.get(i, chr(i)) for i in ids
                       if not (skip_special_tokens and i in SPECIAL))

    def batch_decode(self, seqs: Iterable[Iterable[int]], skip_special_tokens: bool = False,
                     **_: object) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in seqs]

    def encode(self, text: str, add_special_tokens: bool = False, **_: object) -> list[int]:
        ids = [ord(c) for c in text if len(SPECIAL) <= ord(c) < VOCAB]
        return ([self.bos_token_id] if add_special_tokens else []) + ids

    def __call__(self, text: str, add_special_tokens: bool = False, **_: object) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}
