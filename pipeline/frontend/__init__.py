"""The OpenAI-compatible HTTP front end (FastAPI app, request validation, responses, metrics).

No Ray here: the app talks to any object with the engine client's API; `actors/serve_app.py` wraps
it in a Ray Serve deployment."""
