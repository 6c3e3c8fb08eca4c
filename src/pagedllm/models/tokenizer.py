"""Tokenizer and chat template, through HF ``transformers`` (detokenization: ``engine/detokenizer.py``).

A GGUF file carries its own tokenizer; building it with transformers takes seconds, so the
result is saved once under the cache folder (``$PAGEDLLM_CACHE_DIR``, default
``~/.cache/pagedllm``) and loaded from there afterwards. An HF folder without tokenizer files
gives no tokenizer: such a model takes token-id prompts only.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import transformers

from pagedllm.cache_dir import cache_dir, folder_written_once

log = logging.getLogger(__name__)


class Tokenizer:
    """Thin wrapper over an HF tokenizer: encode, decode, chat template, EOS ids."""

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer

    @classmethod
    def load(cls, path: Path, is_gguf: bool) -> Tokenizer | None:
        from transformers import AutoTokenizer

        if not is_gguf:
            has_files = any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
            return cls(AutoTokenizer.from_pretrained(str(path))) if has_files else None
        st = path.stat()
        key = hashlib.sha1(
            f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}".encode()).hexdigest()[:16]
        cached = cache_dir() / "tokenizers" / key
        if (cached / "tokenizer_config.json").exists():
            try:
                return cls(AutoTokenizer.from_pretrained(str(cached)))
            except Exception:  # noqa: BLE001 - a damaged cache is rebuilt
                log.warning("tokenizer cache %s unreadable; rebuilding it", cached)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        try:
            with folder_written_once(cached) as tmp:
                tok.save_pretrained(str(tmp))
        except OSError as e:
            log.warning("could not cache the tokenizer at %s: %s", cached, e)
        return cls(tok)

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` behind a fast tokenizer (None for a slow one)."""
        return getattr(self.hf, "backend_tokenizer", None)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for: the vocabulary's longest
        token string, in UTF-8 bytes (byte-level BPE spells each byte as one 2-byte character,
        SentencePiece a space as a 3-byte one: both over-count, never under-count)."""
        return max(len(token.encode("utf-8", "surrogatepass")) for token in self.hf.get_vocab())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_each(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (special tokens included), as vLLM's ``Logprob.decoded_token``."""
        if self.backend is not None:
            return self.backend.decode_batch([[t] for t in token_ids], skip_special_tokens=False)
        return [self.hf.decode([t], skip_special_tokens=False) for t in token_ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None) -> list[int]:
        """The conversation through the template; ``continue_final_message``: the last message
        left open (no end-of-turn), for the model to go on with it (not with a generation prompt);
        ``tools``: for a template that renders them (``server/tools.py``)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with plain text")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, tools=tools)
        return self.encode(text, add_special_tokens=False)
