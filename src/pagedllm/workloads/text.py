"""Seeded synthetic text prompts for serving benchmarks: random common English words.

A serving benchmark talks to servers whose tokenizer it does not have, so its prompts are text.
``WORDS`` are common English words that SmolLM2's tokenizer (GPT-2 style BPE, as most Llama-family
and Qwen tokenizers are) encodes as one token each, with or without a leading space: a prompt of
N words is N tokens there, and close to N in other BPE vocabularies. The report takes the prompt
token counts from the usage the server returns, so it never relies on this.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORD_TEXT = """
    the of and to in is that for it as was with be by on not he this are or his from at which but
    have an they you were her she there been one all we their has would when if so no will more can
    out other its into time only two may some could these than first then do any like my now over
    such our man me even most made after also did many before must through back years where much
    your way well down should because each just those people how too little state good very make
    world still own see men work long get here between both life being under never day same another
    know while last might us great old year off come since against go came right used take three
    states few house use during without again place around however home small found thought went say
    part once general high upon school every does got left number course war until always away
    something fact though water less public put think almost hand enough far head yet government
    system better set nothing night end why called find going look later point next program city
    business give group young days let room president side social given present several order
    national possible rather second face per among form important often things early white case
    large big need four within felt along children best church ever least power development light
    thing family interest want members mind country area others done although open problem sense
    real knowledge history
"""
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class TextRequest:
    prompt: str
    num_words: int
    output_len: int


def text_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  seed: int | str = 0) -> list[TextRequest]:
    """``num_requests`` prompts of ``input_len`` (min, max) random words, each with an output length
    drawn from ``output_len`` (min, max); the same seed gives the same requests."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n = rng.randint(*input_len)
        out.append(TextRequest(" ".join(rng.choice(WORDS) for _ in range(n)), n, rng.randint(*output_len)))
    return out


def _word_stream(name: str, count: int) -> list[str]:
    """The first ``count`` words of a deterministic stream named ``name`` (same name, same words)."""
    rng = random.Random(name)
    return [rng.choice(WORDS) for _ in range(count)]


def trace_text_workload(trace) -> list[TextRequest]:
    """Text prompts for a trace's requests (``workloads/traces.py``): a request's own ``prompt``, else
    ``prompt_len`` words that keep the trace's sharing as ``traces.prompt_token_ids`` keeps it in
    token ids: its shared prefix's words, then its conversation's (so a turn starts with the
    previous turn's prompt) or its own. One word is one token in SmolLM2's vocabulary."""
    out = []
    for i, r in enumerate(trace):
        if r.prompt is not None:
            out.append(TextRequest(r.prompt, len(r.prompt.split()), r.output_len))
            continue
        head = _word_stream(f"prefix:{r.prefix_id}", r.prefix_len) if r.prefix_len else []
        rest = f"conversation:{r.conversation}" if r.conversation is not None else f"request:{i}"
        words = head + _word_stream(rest, r.prompt_len - r.prefix_len)
        out.append(TextRequest(" ".join(words), len(words), r.output_len))
    return out
