"""Incremental detokenization: deltas equal the full decode, for byte-level BPE (SmolLM2's own
tokenizer) and for a SentencePiece-style tokenizer built here, whose first token of a string
loses its leading space unless the prompt primes the stream."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.models.loader import default_model_path
from pagedllm.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm_tok():
    return Tokenizer.load(default_model_path(), is_gguf=True)


@pytest.fixture(scope="module")
def sentencepiece_tok():
    """Llama-2 style: words carry a '▁' for their leading space, the decoder turns it back into a
    space and strips the one at the start of the text."""
    words = ["The", "capital", "of", "France", "is", "Paris", ".", "It", "has", "café", "s"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in words:
        vocab.setdefault(w, len(vocab))
        vocab.setdefault("▁" + w, len(vocab))
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    rust.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>",
                                             unk_token="<unk>"))


def stream(tok: Tokenizer, prompt: list[int], output: list[int], windowed: bool = False) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    if windowed:  # the path for tokenizers without DecodeStream
        detok = IncrementalDetokenizer(tok, prompt)
        detok._backend = None
    return [detok.add(t) for t in output]


@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("text", [
    "Hello, world!", "naïve café — déjà vu", "emoji: 🙂🚀 and 漢字テスト", "  spaces\n\nnewlines\ttabs",
    "<|im_start|>user\nhi<|im_end|>"])
def test_byte_level_deltas_equal_the_full_decode(smollm_tok, text, windowed):
    ids = smollm_tok.encode(text)
    assert "".join(stream(smollm_tok, [], ids, windowed)) == smollm_tok.decode(ids)


@pytest.mark.parametrize("windowed", [False, True])
def test_byte_level_deltas_after_a_prompt_are_the_continuation(smollm_tok, windowed):
    prompt = smollm_tok.encode("Where is the café?")
    output = smollm_tok.encode(" It is in 漢字 town 🙂.", add_special_tokens=False)
    pieces = stream(smollm_tok, prompt, output, windowed)
    assert "".join(pieces) == " It is in 漢字 town 🙂."
    assert smollm_tok.decode(prompt) + "".join(pieces) == smollm_tok.decode(prompt + output)


@pytest.mark.parametrize("windowed", [False, True])
def test_sentencepiece_first_generated_token_keeps_its_space(sentencepiece_tok, windowed):
    tok = sentencepiece_tok
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    output = tok.encode("Paris . It has café s", add_special_tokens=False)
    output[0] = tok.hf.convert_tokens_to_ids("▁Paris")  # generated after the prompt: a new word
    assert tok.decode(output) == "Paris . It has café s"  # decoded alone, the space is lost
    pieces = stream(tok, prompt, output, windowed)
    assert pieces[0] == " Paris"
    assert "".join(pieces) == " Paris . It has café s"
    assert tok.decode(prompt) + "".join(pieces) == tok.decode(prompt + output)
