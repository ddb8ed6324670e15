import random

import pytest

from ember.bench.config import BenchConfig, Endpoint, LengthDist, Prices


def test_length_specs_parse_and_sample_within_bounds():
    rng = random.Random(0)
    assert LengthDist.parse("128", "x").sample(rng) == 128
    uniform = LengthDist.parse("uniform:10:20", "x")
    samples = [uniform.sample(rng) for _ in range(500)]
    assert min(samples) == 10 and max(samples) == 20
    normal = LengthDist.parse("normal:50:10", "x")
    samples = [normal.sample(rng) for _ in range(500)]
    assert all(1 <= s <= normal.upper() == 80 for s in samples)
    assert 45 < sum(samples) / len(samples) < 55


@pytest.mark.parametrize("spec", ["", "abc", "0", "uniform:5", "uniform:9:3", "normal:5:-1",
                                  "zipf:1:2", "1.5"])
def test_bad_length_specs_name_the_field(spec):
    with pytest.raises(ValueError, match="^output_len: "):
        LengthDist.parse(spec, "output_len")


@pytest.mark.parametrize("field_name, value", [
    ("concurrency", 0), ("rate", 0.0), ("num_requests", 0), ("duration", -1.0), ("turns", 0),
    ("workload", "nope"), ("context_length", 8), ("temperature", -0.5), ("warmup", -1),
])
def test_invalid_config_fields_raise_with_their_name(field_name, value):
    with pytest.raises(ValueError, match=f"^{field_name}: "):
        BenchConfig([Endpoint("a", "http://h")], **{field_name: value})


def test_endpoint_validation_and_api_url():
    assert Endpoint("a", "http://h:1").api_url == "http://h:1/v1"
    assert Endpoint("a", "http://h:1/v1/").api_url == "http://h:1/v1"
    with pytest.raises(ValueError, match="^endpoint.base_url: "):
        Endpoint("a", "h:1")
    with pytest.raises(ValueError, match="^endpoints: names must be unique"):
        BenchConfig([Endpoint("a", "http://h"), Endpoint("a", "http://g")])
    with pytest.raises(ValueError, match="^prices.output: "):
        Prices(1.0, 0.1, -3.0)


def test_defaults_depend_on_the_workload_and_price_table_lookup():
    config = BenchConfig([Endpoint("a", "http://h")], workload="interference", concurrency=3)
    assert config.num_requests == 30
    assert config.input_len == LengthDist("fixed", 64.0)
    special = Prices(1.0, 0.5, 2.0)
    config = BenchConfig([Endpoint("a", "http://h")], duration=5.0,
                         price_table={"kimi": special})
    assert config.num_requests is None
    assert config.prices_for("kimi") == special
    assert config.prices_for("other") == Prices(0.60, 0.10, 3.00)
