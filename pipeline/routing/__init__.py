"""Routing decisions over engine replicas, without Ray (actors/ wires them into Ray Serve)."""
