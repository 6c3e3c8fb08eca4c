"""Tokenizer wrapper and incremental detokenizer (the GGUF's own tokenizer, via transformers)."""

import pytest

from pagedllm.models.loader import default_model_path
from pagedllm.models.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.load(default_model_path(), is_gguf=True)


@pytest.mark.parametrize("text", [
    "Hello, world!", "naïve café — déjà vu", "emoji: 🙂🚀 and 漢字テスト", "  spaces\n\nnewlines\ttabs",
    "<|im_start|>user\nhi<|im_end|>"])
def test_incremental_detokenization_equals_full_decode(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == detok.text == tok.decode(ids)


def test_chat_template_and_special_tokens(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token_id == 2 and tok.vocab_size == 49152
