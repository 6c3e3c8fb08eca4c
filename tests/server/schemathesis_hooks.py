"""schemathesis hooks for tests/server/test_openapi_fuzz.py (loaded with ``SCHEMATHESIS_HOOKS``).

``positive_data_accepted``: schemathesis's ``positive_data_acceptance`` (a request the schema allows
must not be refused), except where a rule no JSON Schema can state refuses it (the list in
``server/openapi.py`` and docs/api.md): such a 400 must have broken one of those rules, told by its
error code or message, and nothing else passes (besides a seed outside int64 that the generator
sent as valid: ``outside_int64``)."""

from __future__ import annotations

import json
import os
import re

import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi.checks import positive_data_acceptance

CROSS_FIELD_CODES = {"context_length_exceeded", "invalid_response_format"}
CROSS_FIELD_MESSAGES = re.compile("|".join([
    r"min_tokens \(\d+\) must be at most max_tokens",                 # min_tokens <= max_tokens
    r"sequences \(prompts x n\)",                                      # prompts x n within the capacity
    r"[a-z_]+: token id \d+ is outside the vocabulary",               # logit_bias keys < vocabulary
    r"^truncation_side: only used with truncate_prompt_tokens",
    r"^logprob_token_ids: only used with logprobs",
    r"response_format and structured_outputs cannot both be given",
    r"response_format\.json_schema\.schema is required",
    r"^structured_outputs",                                            # a JSON schema's text, regex, grammar
    r"^stream_options: only allowed when stream is true",              # as OpenAI
    r"^continue_final_message: cannot be true together with add_generation_prompt",
    r"^[a-z_]+: beam search \(use_beam_search\) does not use it",       # fields beam search would ignore
    r"with use_beam_search",                                           # n <= 10 beams, max_tokens given
    r"^length_penalty: only used with use_beam_search",               # it scores beams, nothing else
    r"^tool_choice: ",                       # needs tools; a named function among them; no response_format beside
    r"tool_calls: arguments must be a JSON object",                    # a history call's arguments
    r"^previous_response_id: no stored response",                      # ids come from earlier responses
    r"its text tokenizes to no token",                                 # the tokenizer drops some characters
    # transformers' template: a last message with no text to continue, or not found in the render
    r"^continue_final_message is set but (we could not find any text|the final message)",
]))


# the batch chat route names the conversation a rule was broken in first ("messages.2: ...")
CONVERSATION = re.compile(r"^messages\.\d+: ")


def broke_a_cross_field_rule(status: int, body: bytes) -> bool:
    if status != 400:
        return False
    error = json.loads(body)["error"]
    message = CONVERSATION.sub("", error["message"])
    return error["code"] in CROSS_FIELD_CODES or bool(CROSS_FIELD_MESSAGES.search(message))


def _tally(what: str) -> None:
    """One line per verdict into ``$PAGEDLLM_ST_TALLY``, so the test knows this check ran."""
    path = os.environ.get("PAGEDLLM_ST_TALLY")
    if path:
        with open(path, "a") as f:
            f.write(what + "\n")


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def outside_int64(case) -> bool:
    """A 64-bit bound (``seed``) rounds to 2^63 as a float in the generator, so it sends 2^63 as
    schema-valid; the schema says ``maximum: 2^63 - 1``, and the server is right to refuse it."""
    body = case.body if isinstance(case.body, dict) else {}
    seed = body.get("seed")
    return isinstance(seed, int) and not isinstance(seed, bool) and not INT64_MIN <= seed <= INT64_MAX


@schemathesis.check
def positive_data_accepted(ctx, response, case):
    try:
        result = positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        if broke_a_cross_field_rule(response.status_code, response.content):
            _tally("cross-field")
            return None
        if response.status_code == 400 and outside_int64(case):
            _tally("outside-int64")
            return None
        _tally("rejected")
        raise
    _tally("checked")
    return result
