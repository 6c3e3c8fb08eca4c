"""SamplingParams validation: clear ValueErrors for out-of-range values; vLLM's conventions."""

import numpy as np
import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.engine.sampling_params import RequestOutputKind


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_p": -1}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"n": 0}, "n must"), ({"n": -1}, "n must"),
    ({"seed": "x"}, "seed"), ({"stop": 5}, "stop"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"temperature": float("nan")}, "temperature"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.1}, "min_p"),
    ({"presence_penalty": 2.1}, "presence_penalty"), ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 5e-324}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"), ({"logprobs": -2}, "logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"), ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {3: "big"}}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words"),
    ({"output_kind": "delta"}, "output_kind"), ({"ignore_eos": 1}, "ignore_eos"),
])
def test_bad_values_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0 and p.n == 1
    assert p.min_p == 0 and p.repetition_penalty == 1.0 and p.output_kind is RequestOutputKind.CUMULATIVE
    assert not p.has_logits_processors
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(top_k=0).top_k == 0  # both: disabled
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]


def test_token_ids_may_be_numpy_or_torch_integers():
    p = SamplingParams(stop_token_ids=np.array([3, 4]), allowed_token_ids=[torch.tensor(7), np.int32(9)],
                       logit_bias={np.int64(5): 2.5, "6": -200})
    assert p.stop_token_ids == [3, 4] and all(type(t) is int for t in p.stop_token_ids)
    assert p.allowed_token_ids == [7, 9]
    assert p.logit_bias == {5: 2.5, 6: -100.0}  # clamped to [-100, 100], as OpenAI does
    assert p.has_logits_processors
    assert sorted(t for _, t in p.token_ids_to_check()) == [3, 4, 5, 6, 7, 9]
