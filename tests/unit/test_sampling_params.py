"""SamplingParams validation: clear ValueErrors for out-of-range values."""

import pytest

from pagedllm import SamplingParams


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_p": -1}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 0}, "top_k"),
    ({"n": 0}, "n must"), ({"n": -1}, "n must"),
    ({"seed": "x"}, "seed"), ({"stop": 5}, "stop"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"temperature": float("nan")}, "temperature"),
])
def test_bad_values_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == -1 and p.n == 1
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
