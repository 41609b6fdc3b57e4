"""Byte-level BPE tokenizer: trained locally with Hugging Face `tokenizers`, or read from any Qwen3 dir.

    tok = Tokenizer.train(texts, vocab_size=4096)     # no downloads: texts come from model/corpus.py
    tok.save(ckpt_dir)                                # tokenizer.json + tokenizer_config.json (chat template)
    tok = Tokenizer.from_dir(ckpt_dir)                # ours, or a real Qwen3 checkpoint's tokenizer.json
    ids = tok.encode_chat(messages, tools, add_generation_prompt=True)

The pipeline is Qwen2/Qwen3's: NFC normalization, its split regex (but for numbers), byte-level mapping, BPE, and
the ChatML special tokens appended after the learned vocabulary. Special-token strings inside text are
encoded as the special tokens (as transformers and vLLM do); callers that must not allow that
escape untrusted text first.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from realtime_rl.model.chat import (
    CHAT_TEMPLATE, ENDOFTEXT, IM_END, IM_START, SPECIAL_TOKENS, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, render_messages,
)
from realtime_rl.types import ChatMessage

# The pre-tokenizer split of Qwen2/Qwen3 (letters, punctuation runs, newlines, spaces) but for numbers: Qwen splits
# single digits and leaves the space before a number on its own; here a number of up to three digits keeps its
# leading space (" 12"), as GPT-2 and cl100k split. A small model copies a constant from the instructions into
# its code by matching the token before it: " first", " 12" is a copy keyed on " first", while " first", " ",
# "1", "2" keys every digit on a space or a digit that precede many numbers (BENCHMARKS.md, pretrain, "Numbers").
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+| ?\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Control tokens are "special" (dropped by decode(skip_special_tokens=True)); tool tags stay visible.
_CONTROL = {ENDOFTEXT, IM_START, IM_END}


def _byte_level_alphabet() -> dict[str, int]:
    """The byte each character of the byte-level vocabulary stands for (GPT-2's table, which tokenizers'
    ByteLevel uses): printable Latin-1 bytes stand for themselves, the other 68 for chr(256 + n) in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_OF = _byte_level_alphabet()


class Tokenizer:
    def __init__(self, hf: HFTokenizer, chat_template: str = CHAT_TEMPLATE) -> None:
        self.hf = hf
        self.chat_template = chat_template
        missing = [t for t in (IM_START, IM_END, ENDOFTEXT) if hf.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks the ChatML tokens {missing}; it cannot render our chat format")
        self.im_start_id: int = hf.token_to_id(IM_START)
        self.im_end_id: int = hf.token_to_id(IM_END)
        self.endoftext_id: int = hf.token_to_id(ENDOFTEXT)
        self.tool_call_open_id: int | None = hf.token_to_id(TOOL_CALL_OPEN)
        self.tool_call_close_id: int | None = hf.token_to_id(TOOL_CALL_CLOSE)
        self._added_ids = frozenset(hf.get_added_tokens_decoder())  # token_bytes asks per token: ask once

    # ------------------------------------------------------------------------------------------ build

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
        """Train byte-level BPE on `texts`; the special tokens take the last ids."""
        if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
            raise ValueError(f"vocab_size {vocab_size} is too small for 256 bytes plus special tokens")
        hf = HFTokenizer(models.BPE())
        hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - len(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer)
        hf.add_tokens([
            AddedToken(t, special=t in _CONTROL, normalized=False, lstrip=False, rstrip=False, single_word=False)
            for t in SPECIAL_TOKENS
        ])
        return cls(hf)

    @classmethod
    def from_file(cls, tokenizer_json: str | Path) -> Tokenizer:
        return cls(HFTokenizer.from_file(str(tokenizer_json)))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Read tokenizer.json (ours or a real Qwen3 checkpoint's); our chat template is always used."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path}: no tokenizer.json")
        return cls.from_file(path / "tokenizer.json")

    def files(self) -> dict[str, bytes]:
        """tokenizer.json and tokenizer_config.json, as save writes them."""
        return {"tokenizer.json": self.hf.to_str(pretty=True).encode(),
                "tokenizer_config.json": (json.dumps(self.tokenizer_config(), indent=2) + "\n").encode()}

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for name, data in self.files().items():
            (path / name).write_bytes(data)

    def tokenizer_config(self) -> dict[str, Any]:
        added = {
            str(i): {"content": t.content, "special": t.special, "lstrip": t.lstrip, "rstrip": t.rstrip,
                     "normalized": t.normalized, "single_word": t.single_word}
            for i, t in sorted(self.hf.get_added_tokens_decoder().items())
        }
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "additional_special_tokens": [IM_START, IM_END],
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
            "model_max_length": 131072,
            "chat_template": self.chat_template,
        }

    # ------------------------------------------------------------------------------------------ use

    @property
    def vocab_size(self) -> int:
        """Number of ids in use, added tokens included."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int:
        return self.im_end_id

    @property
    def pad_token_id(self) -> int:
        return self.endoftext_id

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that end an assistant turn."""
        return [self.im_end_id, self.endoftext_id]

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (part of a UTF-8 character, for some: decode() shows those as
        U+FFFD); an added token's are its text's; none for an id past the tokenizer's vocabulary (a model may
        have more rows, as Qwen3 has: decode() drops such ids too)."""
        token = self.hf.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self._added_ids:
            return token.encode()
        return bytes(_BYTE_OF[c] for c in token)

    def encode_chat(
        self,
        messages: Sequence[ChatMessage | dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> list[int]:
        return self.encode(render_messages(messages, tools, add_generation_prompt))
