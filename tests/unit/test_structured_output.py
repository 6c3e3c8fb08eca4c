"""Structured output pieces alone: StructuredOutputsParams validation, the bitmask applier against a
plain reference, the grammar manager (compile, LRU, errors, time limit, per-step bitmasks against
the matcher's token-by-token verdicts) and the sampler's masking order, on the embedded tokenizer."""

from __future__ import annotations

import json
import time

import pytest
import torch
from pydantic import BaseModel

from pagedllm.engine.request import Request
from pagedllm.engine.sampler import Sampler
from pagedllm.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.engine.scheduler import ScheduledChunk, SchedulerOutput
from pagedllm.engine.structured_output import BitmaskApplier, GrammarBitmask, StructuredOutputManager
from pagedllm.errors import InvalidRequest
from pagedllm.models.loader import default_model_path
from pagedllm.models.tokenizer import Tokenizer

VOCAB = 49152
EOS = 2
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


# -- StructuredOutputsParams --------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({}, "needs one of"),
    ({"json": PERSON, "regex": "a+"}, "json and regex"),
    ({"json_object": True, "choice": ["a"]}, "json_object and choice"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema object"),
    ({"json": 3}, "structured_outputs.json must be a JSON schema"),
    ({"json": {"x": {1, 2}}}, "structured_outputs.json must be JSON-serialisable"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"grammar": 5}, "structured_outputs.grammar"),
    ({"choice": "ab"}, "structured_outputs.choice"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"json_object": 1}, "structured_outputs.json_object"),
    ({"json_object": False}, "needs one of"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace"),
])
def test_bad_structured_outputs_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_params_kinds_and_sampling_params_field():
    assert StructuredOutputsParams(json=PERSON).kind == "json"
    assert StructuredOutputsParams(json=json.dumps(PERSON)).kind == "json"
    assert StructuredOutputsParams(json_object=True, json=None).kind == "json_object"
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]

    class Pet(BaseModel):
        name: str
        legs: int

    assert StructuredOutputsParams(json=Pet).json["required"] == ["name", "legs"]
    assert SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")).structured_outputs.kind == "regex"
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": PERSON})
    import pagedllm

    assert pagedllm.StructuredOutputsParams is StructuredOutputsParams


# -- the bitmask applier ---------------------------------------------------------------------------------
def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for r in range(logits.shape[0]):
        words = bitmask[r].tolist()
        for t in range(logits.shape[1]):
            if t >= 32 * len(words) or not (words[t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("rows, vocab, words", [(3, 96, 3), (2, 70, 3), (4, 100, 3), (1, 32, 1)])
def test_bitmask_applier_equals_the_plain_reference(rows, vocab, words):
    gen = torch.Generator().manual_seed(rows * vocab)
    applier = BitmaskApplier()
    for _ in range(3):  # buffers reused across calls of different sizes
        logits = torch.randn(rows, vocab, generator=gen)
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen, dtype=torch.int32)
        bitmask[0, 0] = -1  # a row with every bit of a word set, and one with none
        if rows > 1:
            bitmask[1, 0] = 0
        expected = reference_apply(logits, bitmask)
        applier.apply(logits, bitmask)
        assert torch.equal(logits, expected)  # allowed logits unchanged bit for bit
        # the same masks on chosen rows of a taller batch; the other rows untouched
        tall = torch.randn(rows + 3, vocab, generator=gen)
        picked = torch.randperm(rows + 3, generator=gen)[:rows]
        expected = tall.clone()
        expected[picked] = reference_apply(tall[picked], bitmask)
        applier.apply(tall, bitmask, picked)
        assert torch.equal(tall, expected)


# -- the manager, on the embedded tokenizer ----------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return Tokenizer.load(default_model_path(), is_gguf=True)


@pytest.fixture
def manager(tok):
    return StructuredOutputManager(tok, VOCAB, [EOS])


def step_of(*chunks: tuple[str, list[str]]) -> SchedulerOutput:
    """A SchedulerOutput whose chunks (request id, fork ids) all sample."""
    return SchedulerOutput(chunks=[ScheduledChunk(rid, [1], 5, [0], True, list(forks)) for rid, forks in chunks])


def allowed_by_mask(bitmask_row: torch.Tensor) -> set[int]:
    words = bitmask_row.tolist()
    return {32 * j + i for j, w in enumerate(words) for i in range(32) if (w >> i) & 1 and 32 * j + i < VOCAB}


def test_compiled_grammars_are_cached_by_spec_in_a_small_lru(tok):
    m = StructuredOutputManager(tok, VOCAB, [EOS], cache_size=2)
    a = m.compile(StructuredOutputsParams(json=PERSON))
    assert m.compile(StructuredOutputsParams(json=json.loads(json.dumps(PERSON)))) is a  # same text: a hit
    assert m.num_compiled == 1
    m.compile(StructuredOutputsParams(json=PERSON, disable_any_whitespace=True))  # other options: compiled
    m.compile(StructuredOutputsParams(regex="[0-9]+"))  # evicts the least recently used (PERSON)
    assert m.num_compiled == 3
    assert m.compile(StructuredOutputsParams(json=PERSON)) is not a
    assert m.num_compiled == 4


def test_compile_may_run_on_other_threads(tok):
    from concurrent.futures import ThreadPoolExecutor

    m = StructuredOutputManager(tok, VOCAB, [EOS], cache_size=4)
    specs = [StructuredOutputsParams(regex=f"[a-z]{{{i}}}") for i in range(1, 7)] * 3
    with ThreadPoolExecutor(4) as pool:
        grammars = list(pool.map(m.compile, specs))
    assert all(g is not None for g in grammars) and len(m._cache) == 4
    m.add(["a"], m.compile(specs[0]))
    assert m.accept("a", tok.encode("x", add_special_tokens=False)[0]) == (True, None)


@pytest.mark.parametrize("params, message", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "strin"}}}),
     r"structured_outputs\.json is invalid: .*strin"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}),
     r"structured_outputs\.json is invalid: .*/defs/x"),
    (StructuredOutputsParams(regex="(("), r"(?s)structured_outputs\.regex is invalid: .*unclosed group"),
    (StructuredOutputsParams(grammar="start: nowhere"), r"structured_outputs\.grammar is invalid: .*nowhere"),
])
def test_invalid_specs_raise_invalid_request_naming_the_problem(manager, params, message):
    with pytest.raises(InvalidRequest, match=message):
        manager.compile(params)
    assert manager.num_compiled == 0 and len(manager) == 0


def test_compile_over_the_time_limit_is_an_invalid_request(tok, monkeypatch):
    from pagedllm.engine import structured_output

    real = structured_output._llguidance_grammar

    def slow(*args):  # a grammar that takes 2 s to build
        time.sleep(2.0)
        return real(*args)

    m = StructuredOutputManager(tok, VOCAB, [EOS], compile_timeout=0.2)
    monkeypatch.setattr(structured_output, "_llguidance_grammar", slow)
    with pytest.raises(InvalidRequest, match=r"structured_outputs\.json: compiling the grammar took longer than "
                                             r"the 0\.2 s limit"):
        m.compile(StructuredOutputsParams(json=PERSON))
    assert m.num_compiled == 0
    monkeypatch.setattr(structured_output, "_llguidance_grammar", real)
    assert m.compile(StructuredOutputsParams(json=PERSON)) is not None  # the abandoned compile blocks nothing


def test_no_matchers_no_bitmask_and_only_sampling_sequences_with_a_grammar_get_rows(manager):
    assert manager.bitmask(step_of(("free", []))) is None
    grammar = manager.compile(StructuredOutputsParams(json=PERSON))
    manager.add(["s#0", "s#1", "t"], grammar)
    assert manager.bitmask(step_of(("free", []))) is None
    out = step_of(("free", []), ("s#0", ["s#1"]))
    out.chunks.append(ScheduledChunk("t", [1, 2], 0, [0], False))  # a prefill chunk that does not sample
    mask = manager.bitmask(out)
    assert mask.rows == {"s#0": 0, "s#1": 1} and mask.bitmask.shape == (2, VOCAB // 32)
    assert torch.equal(mask.bitmask[0], mask.bitmask[1])  # siblings start at the same state
    for sid in ("s#0", "s#1", "t"):
        manager.release(sid)
    assert len(manager) == 0 and manager.bitmask(out) is None


def walk(manager: StructuredOutputManager, tok, params: StructuredOutputsParams, text: str):
    """Two sequences walk ``text`` + EOS; yields, per step, (token, mask row of each, the tokens a copy of
    the grammar's matcher accepts one by one (``validate_tokens``), whether the grammar has stopped)."""
    grammar = manager.compile(params)
    manager.add(["a", "b"], grammar)
    reference = grammar.deep_copy()
    for token in [*tok.encode(text, add_special_tokens=False), EOS]:
        mask = manager.bitmask(step_of(("b", []), ("a", [])))
        verdicts = {t for t in range(VOCAB) if reference.validate_tokens([t]) == 1}
        yield token, allowed_by_mask(mask.bitmask[mask.rows["a"]]), allowed_by_mask(mask.bitmask[mask.rows["b"]]), \
            verdicts, reference.is_stopped()
        a, b = manager.accept("a", token), manager.accept("b", token)
        assert a == b and a.error is None
        reference.consume_token(token)


def test_masks_equal_the_matchers_token_by_token_verdicts(manager, tok):
    """A regex with nothing forced: every step's mask is exactly the set of tokens the matcher accepts."""
    steps = list(walk(manager, tok, StructuredOutputsParams(regex="[a-z]{1,6}-[0-9]{2,4}"), "abc-123"))
    assert len(steps) == 6
    for i, (token, mask_a, mask_b, verdicts, _) in enumerate(steps):
        assert mask_a == mask_b == verdicts, f"step {i}"
        assert token in mask_a and (EOS in mask_a) == (i >= 4)  # EOS once 2 digits are there
    assert 0 < len(steps[2][1]) < 20  # after '-': digits only


def test_json_masks_hold_the_verdicts_but_only_the_tokenizers_own_token_for_forced_text(manager, tok):
    """JSON: where the schema leaves a choice the mask is exactly the matcher's verdicts; where it forces
    text (a required key's name) llguidance allows only the token the tokenizer itself would produce,
    not the shorter prefixes that are also valid; once the object is closed, only EOS."""
    doc = json.dumps({"name": "Ada", "age": 36})
    steps = list(walk(manager, tok, StructuredOutputsParams(json=PERSON), doc))
    forced = []
    for i, (token, mask, _, verdicts, stopped) in enumerate(steps):
        if stopped:
            assert mask == {EOS} and i == len(steps) - 1
        elif mask != verdicts:
            assert mask == {token} and mask < verdicts, f"step {i}"
            prefixes = {tok.decode([t]) for t in verdicts - mask}
            assert all(tok.decode([token]).startswith(p) for p in prefixes)
            forced.append(tok.decode([token]))
        else:
            assert token in mask and len(mask) > 1, f"step {i}"
    assert forced == ["name", "age"]


def test_a_rejected_token_is_reported_not_raised(manager, tok):
    manager.add(["a"], manager.compile(StructuredOutputsParams(choice=["yes", "no"])))
    bad = tok.encode("maybe", add_special_tokens=False)[0]
    result = manager.accept("a", bad)
    assert not result.completed and result.error.startswith(f"structured output: the grammar rejected token {bad}")


# -- the sampler's order ------------------------------------------------------------------------------------
def test_sampler_masks_grammar_rows_first_and_leaves_other_rows_and_logprobs_raw():
    vocab = 64
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen)
    allowed = [5, 40]
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[0, 1] = 1 << 8
    top = int(logits[1].argmax())
    bias = {top: 100.0} if top not in allowed else {0: 100.0}  # a bias cannot revive a masked token
    sampler = Sampler()
    for logprobs in (2, None):
        reqs = [Request("free", [1], SamplingParams(temperature=0, logprobs=2), max_tokens=5),
                Request("g", [1], SamplingParams(temperature=0, logprobs=logprobs, logit_bias=bias), max_tokens=5),
                Request("free2", [1], SamplingParams(temperature=0), max_tokens=5)]
        raw = logits.clone()
        tokens, lps = sampler.sample(logits, reqs, [None] * 3, GrammarBitmask({"g": 0}, bitmask))
        assert tokens[0] == int(raw[0].argmax()) and tokens[2] == int(raw[2].argmax())
        assert tokens[1] == max(allowed, key=lambda t: float(raw[1, t]))
        if logprobs:  # the raw distribution's, not the masked one's; the caller's logits untouched
            assert lps[1].logprob == pytest.approx(torch.log_softmax(raw[1], -1)[tokens[1]].item())
            assert torch.equal(logits, raw)
        else:  # masked in place, other rows (and their logprobs) untouched
            assert torch.equal(logits[[0, 2]], raw[[0, 2]]) and torch.isinf(logits[1]).sum() == vocab - 2
            assert lps[0].logprob == pytest.approx(torch.log_softmax(raw[0], -1)[tokens[0]].item())
            logits = raw
