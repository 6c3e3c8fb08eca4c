"""Tokenizer wrapper (the GGUF's own tokenizer, via transformers)."""

import pytest

from pagedllm.models.loader import default_model_path
from pagedllm.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.load(default_model_path(), is_gguf=True)


def test_chat_template_and_special_tokens(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token_id == 2 and tok.vocab_size == 49152
