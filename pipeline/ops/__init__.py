"""What operators look at and are woken by: the Grafana dashboard and the Prometheus alert rules,
each defined once here as data. `python -m pipeline.ops` writes them into the chart
(helm/specrelay/files/), from where the chart ships them and the tests read them."""
