"""The served OpenAPI document (`/openapi.json`), built from the request models."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pipeline.frontend.requests import ChatCompletionRequest, CompletionRequest


def openapi_schema() -> dict[str, Any]:
    """OpenAPI 3.1, with OpenAI error bodies for every error status (schema fuzzers use it)."""
    components: dict[str, Any] = {}

    def body_ref(model: type[BaseModel]) -> dict[str, Any]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        return {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}

    error = {"description": "an OpenAI error body", "content": {"application/json": {
        "schema": {"type": "object", "required": ["error"]}}}}
    errors = {str(code): error for code in (400, 401, 404, 408, 413, 429, 431, 503)}
    ok_json = {"description": "OK", "content": {"application/json": {"schema": {}}}}
    ok_any = {"description": "OK (JSON, or an SSE stream when stream is true)"}

    def post(model: type[BaseModel]) -> dict[str, Any]:
        return {"post": {"requestBody": body_ref(model), "responses": {"200": ok_any, **errors}}}

    def get(ok: dict[str, Any]) -> dict[str, Any]:
        return {"get": {"responses": {"200": ok, **errors}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "specrelay", "version": "1"},
        "paths": {
            "/v1/completions": post(CompletionRequest),
            "/v1/chat/completions": post(ChatCompletionRequest),
            "/v1/models": get(ok_json),
            "/health": get(ok_json),
            "/metrics": get({"description": "Prometheus text"}),
        },
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }
