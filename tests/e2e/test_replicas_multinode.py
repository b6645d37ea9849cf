"""Two engine replicas on a local three-node Ray cluster (issue 44, must-show 1; the nodes of
tests/support/local_cluster.py, the Ray side in tests/support/replicas_driver.py): greedy output
identical to one replica, and one trace per request across the ingress, the replica that served
it, its engine and its stage actors, with spans written on more than one node."""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict

import pytest
from support.local_cluster import Cluster
from support.serve_helpers import ROOT, ray_cli_env

from pipeline.tracing.trace_file import read_spans

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

DRIVER = f"{ROOT}/tests/support/replicas_driver.py"
NODES = {"head": {"sr_node_head": 1}, "a": {"sr_node_a": 1}, "b": {"sr_node_b": 1}}
# Every request's trace: the ingress's HTTP span, the replica's, the engine's, the output stage's.
HOPS = ("POST /v1/completions", "spec.replica.request", "spec.engine.request", "spec.request")


@pytest.fixture
def cluster():
    tmp = tempfile.mkdtemp(prefix="srrp", dir="/tmp")
    nodes = Cluster(tmp, NODES)
    try:
        for name in NODES:
            nodes.start(name)
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_two_replicas_across_nodes_answer_as_one_and_trace_each_request_end_to_end(cluster,
                                                                                 tmp_path):
    run = subprocess.run([sys.executable, DRIVER, cluster.address, str(tmp_path)], cwd=ROOT,
                         check=False,
                         env=ray_cli_env(), capture_output=True, text=True, timeout=800)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith('{"event": "result"')]
    assert lines, run.stderr[-4000:]
    result = json.loads(lines[-1])
    one, two = result["one"], result["two"]
    print("\nreplicas multinode: " + json.dumps({k: {"start_s": v["start_s"],
                                                     "placement": v["placement"]}
                                                 for k, v in (("one", one), ("two", two))}))

    # Greedy: the same answers from two replicas as from one.
    assert [a["text"] for a in two["answers"]] == [a["text"] for a in one["answers"]]
    assert len(two["placement"]) == 2
    # Each replica is a whole engine; together they run on more than one node.
    nodes = {p["node"] for actors in two["placement"].values() for p in actors.values()}
    assert len(nodes) >= 2, two["placement"]

    spans = read_spans(glob.glob(str(tmp_path / "spans-*.jsonl")))
    by_trace = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    served = set()
    for answer in two["answers"]:
        trace = by_trace[answer["trace_id"]]
        names = [s.name for s in trace]
        assert all(names.count(hop) == 1 for hop in HOPS), names
        ingress = next(s for s in trace if s.name == HOPS[0])
        replica = next(s for s in trace if s.name == HOPS[1])
        assert replica.parent_span_id == ingress.span_id  # the hop joins the trace
        assert replica.attributes["request.id"] == answer["id"] + "-0"
        served.add(replica.attributes["serve.replica"])
        assert any(s.name == "spec.verify_step" for s in spans
                   if any(link.trace_id == answer["trace_id"] for link in s.links))
        assert len({s.resource.get("specrelay.node") for s in trace}) >= 2, trace
    assert served == set(two["placement"]), served  # both replicas served requests
