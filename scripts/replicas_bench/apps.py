"""A local Ray cluster serving the same Serve application twice: with one engine replica and with
several, each under its own route prefix."""

from __future__ import annotations

import time
from typing import Any

from scripts.harness import free_port, wait_healthy

ONE, MANY = "bench-r1", "bench-rn"  # the two applications (and their route prefixes)


def start_apps(config: str, replicas: int, overrides: dict[str, Any], cpus: int) -> str:
    """A local Ray with `cpus` logical CPUs, Serve on a free loopback port, and the two apps;
    returns the base URL."""
    import ray
    from ray import serve

    from actors.serve_app import build_app

    if not ray.is_initialized():  # a test's cluster is reused (its CPUs are its own)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    wait_for_resources(config, overrides, 1 + replicas)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    for name, n in ((ONE, 1), (MANY, replicas)):
        serve.run(build_app({"config": config, "overrides": overrides, "num_replicas": n,
                             "request_timeout_s": 600}),
                  name=name, route_prefix=f"/{name}", blocking=False)
    base = f"http://127.0.0.1:{port}"
    for name in (ONE, MANY):
        wait_healthy(f"{base}/{name}")
    return base


def wait_for_resources(config: str, overrides: dict[str, Any], engines: int,
                       timeout: float = 60.0) -> None:
    """Wait until the cluster has the verifier placement groups of `engines` engines free; a
    clear error otherwise, where serve.run would wait for them forever."""
    import ray

    from pipeline.config import load_config

    cfg = load_config(config, overrides)
    need: dict[str, float] = {}
    for bundle in cfg.placement_spec.verifier_bundles(
            cfg.tensor_parallel_size, cfg.device.startswith("cuda")) * engines:
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + amount
    deadline = time.monotonic() + timeout
    while any((free := ray.available_resources()).get(k, 0.0) < v for k, v in need.items()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{engines} engines need {need} for their verifier ranks; the "
                               f"cluster has {free} free of {ray.cluster_resources()}")
        time.sleep(0.5)


def stop_apps(own_ray: bool) -> None:
    import ray
    from ray import serve

    serve.shutdown()
    if own_ray:
        ray.shutdown()
