"""The Grafana dashboard and Prometheus alert rules, defined once as data; `python -m pipeline.ops`
writes them into the chart (helm/specrelay/files/)."""
