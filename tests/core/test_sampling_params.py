import pytest

from ember.core.sampling_params import SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0),
    ("max_tokens", 0), ("n", 0), ("logprobs", 21), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("stop", [""]),
    ("stop_token_ids", [-1]), ("seed", "x"), ("temperature", "hot"),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_defaults_and_normalisation():
    params = SamplingParams(stop="END", top_k=-1, temperature=0)
    assert params.stop == ["END"]
    assert params.top_k == 0
    assert params.greedy and not params.has_penalties
