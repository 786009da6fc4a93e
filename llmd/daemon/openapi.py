"""GET /openapi.json: the daemon's API (OpenAI, Anthropic, Ollama and llmd's own routes) as OpenAPI
3.1, with request bodies generated from the same pydantic models the routes validate with.

Responses are described only by status (they follow each API's own published shapes); the schema is
what schemathesis fuzzes in the test suite.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmd import __version__
from llmd.daemon.routes import (
    anthropic,
    control,
    embeddings,
    infill,
    ollama,
    ollama_models,
    openai,
    responses,
)

BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("POST", "/v1/chat/completions"): openai.ChatBody,
    ("POST", "/v1/completions"): openai.CompletionBody,
    ("POST", "/llmd/warm"): openai.ChatBody,
    ("POST", "/v1/embeddings"): embeddings.OpenAIBody,
    ("POST", "/v1/responses"): responses.ResponsesBody,
    ("POST", "/v1/messages"): anthropic.MessagesBody,
    ("POST", "/v1/messages/count_tokens"): anthropic.CountBody,
    ("POST", "/infill"): infill.InfillBody,
    ("POST", "/api/chat"): ollama.ChatBody,
    ("POST", "/api/generate"): ollama.GenerateBody,
    ("POST", "/api/show"): ollama.ShowBody,
    ("POST", "/api/embed"): embeddings.OllamaBody,
    ("POST", "/api/embeddings"): embeddings.LegacyBody,
    ("POST", "/api/pull"): ollama_models.PullBody,
    ("DELETE", "/api/delete"): ollama_models.DeleteBody,
    ("POST", "/api/copy"): ollama_models.CopyBody,
    ("POST", "/llmd/models"): control.AddModelBody,
    ("POST", "/llmd/models/remote"): control.AddRemoteBody,
    ("POST", "/llmd/models/load"): control.ModelRefBody,
    ("POST", "/llmd/models/unload"): control.ModelRefBody,
    ("POST", "/llmd/models/active"): control.ModelRefBody,
    ("POST", "/llmd/models/pair"): control.PairBody,
    ("POST", "/llmd/speculation"): control.SpeculationBody,
    ("POST", "/llmd/cache/clear"): control.ClearCacheBody,
}
TOKEN_ROUTES = {path for (_, path) in BODIES if path.startswith("/llmd/") and path != "/llmd/warm"}


def _tag(path: str) -> str:
    if path.startswith("/api/"):
        return "ollama"
    if path.startswith("/v1/messages"):
        return "anthropic"
    return "openai" if path.startswith("/v1/") else "llmd"


def build(routes: list[Any]) -> dict[str, Any]:
    models = sorted(set(BODIES.values()), key=lambda m: m.__name__)
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route) or route.path == "/openapi.json":
            continue
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
        params = re.findall(r"\{(\w+)\}", path)
        for method in sorted((route.methods or set()) - {"HEAD"}):
            doc = (route.endpoint.__doc__ or route.name.replace("_", " ")).strip().splitlines()[0]
            op: dict[str, Any] = {"operationId": f"{method.lower()}_{route.name}_{len(paths)}", "summary": doc,
                                  "tags": [_tag(path)],
                                  "responses": {"200": {"description": "the API's reply"},
                                                "4XX": {"description": "what was wrong, in the API's error shape"},
                                                "503": {"description": "queue full or model unavailable"}}}
            if params:
                op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                                    for p in params]
            model = BODIES.get((method, route.path))
            if model is not None:
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": refs[(model, "validation")]}}}
            if route.path in TOKEN_ROUTES or (method == "DELETE" and path.startswith("/llmd/")):
                op["security"] = [{"token": []}]
            paths.setdefault(path, {})[method.lower()] = op
    return {"openapi": "3.1.0",
            "info": {"title": "llmd", "version": __version__,
                     "description": "A local LLM inference daemon: OpenAI-, Anthropic- and Ollama-compatible APIs"},
            "paths": paths,
            "components": {"schemas": defs.get("$defs", {}),
                           "securitySchemes": {"token": {"type": "http", "scheme": "bearer"}}}}


async def openapi_json(request: Request) -> Response:
    """The OpenAPI schema of every route."""
    if not hasattr(request.app.state, "openapi"):
        request.app.state.openapi = build(request.app.routes)
    return JSONResponse(request.app.state.openapi)


routes = [Route("/openapi.json", openapi_json, methods=["GET"])]
