"""The parts of scripts/bench_replicas.py: the local cluster and its two Serve apps (`apps`) and
the ingress -> replica hop measurements (`hop`). The shared machinery is scripts/harness.py."""
