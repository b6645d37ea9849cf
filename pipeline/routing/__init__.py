"""How requests reach engine replicas: the routing decisions, without Ray (actors/ wires them
into Ray Serve's request-router API)."""
