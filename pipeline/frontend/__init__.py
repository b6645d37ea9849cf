"""The OpenAI-compatible HTTP front end; no Ray (`actors/serve_app.py` wraps it in Serve)."""
