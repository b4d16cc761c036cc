"""The OpenAPI 3.1 document served at /openapi.json, built from the same pydantic models that
validate requests, so the schema and the 400s cannot disagree."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from . import __version__
from .schemas import ChatCompletionRequest, CompletionRequest, MetaserverRegistration

REQUEST_ID_PATTERN = r"^[\x21-\x7e]{1,128}$"
_REF = "#/components/schemas/{model}"
# One server-sent event (OpenAPI 3.2 `itemSchema`): `data` is a JSON chunk, an error, or [DONE].
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=_REF)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def build_openapi(api_key_required: bool) -> dict[str, Any]:
    components: dict[str, Any] = {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": {"type": ["string", "null"]}, "code": {}}}}},
        "Object": {"type": "object"},
        "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
            "id": {"type": "string", "minLength": 1}, "object": {"const": "model"},
            "created": {"type": "integer", "minimum": 0}, "owned_by": {"type": "string"}}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {"$ref": _REF.format(model="Model")}}}},
    }
    err = {"$ref": _REF.format(model="Error")}
    obj = {"$ref": _REF.format(model="Object")}
    rid = {"name": "X-Request-Id", "in": "header", "required": False,
           "description": "Honoured and forwarded to decoder and prefiller; assigned if absent.",
           "schema": {"type": "string", "pattern": REQUEST_ID_PATTERN}}
    errors = {str(s): _json(err, d) for s, d in (
        (400, "Malformed JSON or a field of the wrong type (the message names it)"),
        (401, "Missing or wrong API key"), (413, "Request body larger than --max-request-bytes"),
        (502, "A backend failed"), (503, "No backend reachable, or shutting down"),
        (504, "A backend timed out"))}

    def generate(model: type[BaseModel], summary: str) -> dict[str, Any]:
        op = {"summary": summary, "parameters": [rid],
              "requestBody": {"required": True,
                              "content": {"application/json": {"schema": _schema(model, components)}}},
              "responses": {"200": {"description": "OpenAI response (JSON, or SSE when stream)",
                                    "content": {"application/json": {"schema": obj},
                                                "text/event-stream": {"itemSchema": _SSE_EVENT}}},
                            **errors}}
        if api_key_required:
            op["security"] = [{"bearer": []}]
        return {"post": op}

    meta_errors = {str(s): _json(err, d) for s, d in (
        (400, "Malformed registration"), (404, "Unknown or finished request_id"),
        (409, "request_id re-registered with other params"), (410, "Client request ended"),
        (413, "Body too large"), (502, "The prefill dispatch failed (body names the prefiller)"),
        (503, "No prefiller reachable"), (504, "Prefill or registration timed out"))}
    paths = {
        "/v1/completions": generate(CompletionRequest, "Text completion (prompt lists batched)"),
        "/v1/chat/completions": generate(ChatCompletionRequest, "Chat completion"),
        "/v1/models": {"get": {
            "summary": "The models the decoders serve (OpenAI list; each decoder's GET /v1/models, "
                       "merged, de-duplicated, cached a few seconds)",
            "parameters": [rid],
            "responses": {"200": _json({"$ref": _REF.format(model="ModelList")},
                                       "The ids clients may name in `model`"),
                          "400": _json(err, "Malformed X-Request-Id header"),
                          "503": _json(err, "No decoder answered its GET /v1/models")}}},
        "/v1/metaserver": {"post": {
            "summary": "Decoder registration; answered once the prefill dispatch completed",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": _schema(MetaserverRegistration, components)}}},
            "responses": {"200": _json({"type": "object", "properties": {
                "status": {"const": "ok"}}}, "Prefill dispatched and completed"),
                **meta_errors}}},
        "/healthcheck": {"get": {"summary": "Probes every backend's /health", "responses": {
            "200": _json(obj, "All backends healthy"),
            "503": _json(obj, "A backend is down, or the proxy is shutting down")}}},
        "/reset_prefix_cache": {"post": {"summary": "Forwarded to every prefiller and decoder",
                                         "responses": {"200": _json(obj, "All backends reset"),
                                                       "502": _json(obj, "A backend failed")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
            "description": "Prometheus text format",
            "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
    }
    if api_key_required:
        for path in ("/v1/models", "/reset_prefix_cache", "/metrics"):
            for op in paths[path].values():
                op["security"] = [{"bearer": []}]
                op["responses"]["401"] = errors["401"]
        meta = paths["/v1/metaserver"]["post"]
        meta["security"] = [{"metaserverToken": []}]
        meta["responses"]["401"] = _json(err, "Missing token, or not the one issued for this request_id")
        paths["/healthcheck"]["get"]["description"] = (
            "Open (load balancers); without the API key the body has only `status`, not `backends`.")
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "kvoffload proxy", "version": __version__,
                 "description": "OpenAI-compatible front door of kvoffload's layerwise P/D "
                                "deployment (decode first)."},
        "paths": paths, "components": {"schemas": components}}
    if api_key_required:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "The proxy's --api-key ($KVOFFLOAD_API_KEY)."},
            "metaserverToken": {"type": "http", "scheme": "bearer",
                                "description": "Decoders only: kv_transfer_params.metaserver_token of "
                                               "the request being registered (issued per request)."}}
    return doc
