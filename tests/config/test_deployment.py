"""The `deployment:` section: replicas, routing and Ray Serve's autoscaling_config."""

import pytest

from pipeline.config import load_config
from pipeline.deployment import DeploymentSettings, parse_deployment


def test_defaults_are_one_replica_with_prefix_routing_and_no_autoscaling():
    d = parse_deployment({})
    assert d == DeploymentSettings() and d.replicas == 1 and d.routing == "prefix"
    assert d.autoscaling_config is None
    assert load_config(None).deployment_settings == d


def test_autoscaling_becomes_rays_config_field_for_field():
    d = parse_deployment({"routing": "pow2", "autoscaling": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
        "upscale_delay_s": 1, "downscale_delay_s": 2}})
    assert d.routing == "pow2"
    assert d.autoscaling_config == {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
        "upscale_delay_s": 1, "downscale_delay_s": 2, "metrics_interval_s": 10.0,
        "look_back_period_s": 30.0}


@pytest.mark.parametrize(("raw", "field"), [
    ({"replicas": 0}, "deployment.replicas"),
    ({"replicas": "2"}, "deployment.replicas"),
    ({"routing": "random"}, "deployment.routing"),
    ({"imbalance_threshold": -1}, "deployment.imbalance_threshold"),
    ({"replica": 2}, "deployment: unknown key(s) replica"),
    ({"autoscaling": 3}, "deployment.autoscaling"),
    ({"autoscaling": {"max": 3}}, "deployment.autoscaling: unknown key(s) max"),
    ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "deployment.autoscaling.max_replicas"),
    ({"autoscaling": {"initial_replicas": 9}}, "deployment.autoscaling.initial_replicas"),
    ({"autoscaling": {"target_ongoing_requests": 0}},
     "deployment.autoscaling.target_ongoing_requests"),
    ({"autoscaling": {"downscale_delay_s": -1}}, "deployment.autoscaling.downscale_delay_s"),
])
def test_bad_values_name_the_field(raw, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        parse_deployment(raw)
    with pytest.raises(ValueError, match="deployment"):
        load_config(None, {"deployment": raw})
