"""RouterConfig validation names the bad field."""

from __future__ import annotations

import pytest

from ember.router.config import RouterConfig, normalize_url


def test_urls_are_normalized_and_deduplicated():
    config = RouterConfig(replicas=["http://a:1/", "http://b:2/v1"])
    assert config.replicas == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="^replicas: must be unique"):
        RouterConfig(replicas=["http://a:1", "http://a:1/v1"])


@pytest.mark.parametrize("field, value", [
    ("policy", "random"), ("port", 0), ("max_load", 0), ("eject_after", 0),
    ("health_interval", 0.0), ("read_timeout", -1.0), ("retries", 2), ("admin_key", "short"),
    ("health_path", "health"), ("prefix_capacity", 0),
])
def test_bad_fields_are_named(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        RouterConfig(replicas=["http://a:1"], **{field: value})


def test_needs_some_way_to_get_replicas():
    with pytest.raises(ValueError, match="^replicas: need at least one"):
        RouterConfig()
    assert RouterConfig(admin_key="k" * 8).replicas == []


def test_normalize_url_rejects_other_schemes():
    with pytest.raises(ValueError, match="^url: must start with http"):
        normalize_url("10.0.0.1:8000", "url")
