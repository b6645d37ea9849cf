"""OpenTelemetry set-up, the JSON-lines trace file, and the `specrelay trace` reader."""
