"""The OpenAPI 3.1 document served at /openapi.json, built from the same pydantic models that
validate requests (the OpenAI bodies: ``openai_api.body_types``; the registration: ``schemas``), so
the schema and the 400s cannot disagree."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from openai_api.body_types import ChatCompletionRequest, CompletionRequest

from . import __version__
from .schemas import MetaserverRegistration

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


def _ref(model: str) -> dict[str, Any]:
    return {"$ref": _REF.format(model=model)}


def _base_components() -> dict[str, Any]:
    """The hand-written schemas: the OpenAI error body, any JSON object, and the model list."""
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {},
                    },
                }
            },
        },
        "Object": {"type": "object"},
        "Model": {
            "type": "object",
            "required": ["id", "object", "created", "owned_by"],
            "properties": {
                "id": {"type": "string", "minLength": 1},
                "object": {"const": "model"},
                "created": {"type": "integer", "minimum": 0},
                "owned_by": {"type": "string"},
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}},
        },
    }


def _request_id_param() -> dict[str, Any]:
    return {
        "name": "X-Request-Id",
        "in": "header",
        "required": False,
        "description": "Honoured and forwarded to decoder and prefiller; assigned if absent.",
        "schema": {"type": "string", "pattern": REQUEST_ID_PATTERN},
    }


def _error_responses(statuses: tuple[tuple[int, str], ...]) -> dict[str, Any]:
    return {str(s): _json(_ref("Error"), d) for s, d in statuses}


_GENERATE_ERRORS = (
    (400, "Malformed JSON or a field of the wrong type (the message names it)"),
    (401, "Missing or wrong API key"),
    (413, "Request body larger than --max-request-bytes"),
    (502, "A backend failed"),
    (503, "No backend reachable, or shutting down"),
    (504, "A backend timed out"),
)
_METASERVER_ERRORS = (
    (400, "Malformed registration"),
    (404, "Unknown or finished request_id"),
    (409, "request_id re-registered with other params"),
    (410, "Client request ended"),
    (413, "Body too large"),
    (502, "The prefill dispatch failed (body names the prefiller)"),
    (503, "No prefiller reachable"),
    (504, "Prefill or registration timed out"),
)


def _generate_path(
    model: type[BaseModel], summary: str, components: dict[str, Any], errors: dict[str, Any], api_key_required: bool
) -> dict[str, Any]:
    """A generation route: the request model's schema, a JSON or SSE answer, the errors."""
    op = {
        "summary": summary,
        "parameters": [_request_id_param()],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _schema(model, components)}}},
        "responses": {
            "200": {
                "description": "OpenAI response (JSON, or SSE when stream)",
                "content": {
                    "application/json": {"schema": _ref("Object")},
                    "text/event-stream": {"itemSchema": _SSE_EVENT},
                },
            },
            **errors,
        },
    }
    if api_key_required:
        op["security"] = [{"bearer": []}]
    return {"post": op}


def _paths(components: dict[str, Any], errors: dict[str, Any], api_key_required: bool) -> dict[str, Any]:
    """Every route the proxy serves, before the API key's security requirements are added."""
    return {
        "/v1/completions": _generate_path(
            CompletionRequest, "Text completion (prompt lists batched)", components, errors, api_key_required
        ),
        "/v1/chat/completions": _generate_path(
            ChatCompletionRequest, "Chat completion", components, errors, api_key_required
        ),
        "/v1/models": _models_path(),
        "/v1/metaserver": _metaserver_path(components),
        **_admin_paths(),
    }


def _models_path() -> dict[str, Any]:
    err = _ref("Error")
    return {
        "get": {
            "summary": "The models the decoders serve (OpenAI list; each decoder's GET /v1/models, "
            "merged, de-duplicated, cached a few seconds)",
            "parameters": [_request_id_param()],
            "responses": {
                "200": _json(_ref("ModelList"), "The ids clients may name in `model`"),
                "400": _json(err, "Malformed X-Request-Id header"),
                "503": _json(err, "No decoder answered its GET /v1/models"),
            },
        }
    }


def _metaserver_path(components: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": "Decoder registration; answered once the prefill dispatch completed",
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _schema(MetaserverRegistration, components)}},
            },
            "responses": {
                "200": _json(
                    {"type": "object", "properties": {"status": {"const": "ok"}}},
                    "Prefill dispatched and completed",
                ),
                **_error_responses(_METASERVER_ERRORS),
            },
        }
    }


def _admin_paths() -> dict[str, Any]:
    """/healthcheck, /reset_prefix_cache and /metrics."""
    obj = _ref("Object")
    return {
        "/healthcheck": {
            "get": {
                "summary": "Probes every backend's /health",
                "responses": {
                    "200": _json(obj, "All backends healthy"),
                    "503": _json(obj, "A backend is down, or the proxy is shutting down"),
                },
            }
        },
        "/reset_prefix_cache": {
            "post": {
                "summary": "Forwarded to every prefiller and decoder",
                "responses": {"200": _json(obj, "All backends reset"), "502": _json(obj, "A backend failed")},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
    }


def _require_keys(paths: dict[str, Any], errors: dict[str, Any]) -> None:
    """With --api-key: the bearer key on the admin routes, the per-request token on /v1/metaserver."""
    for path in ("/v1/models", "/reset_prefix_cache", "/metrics"):
        for op in paths[path].values():
            op["security"] = [{"bearer": []}]
            op["responses"]["401"] = errors["401"]
    meta = paths["/v1/metaserver"]["post"]
    meta["security"] = [{"metaserverToken": []}]
    meta["responses"]["401"] = _json(_ref("Error"), "Missing token, or not the one issued for this request_id")
    paths["/healthcheck"]["get"]["description"] = (
        "Open (load balancers); without the API key the body has only `status`, not `backends`."
    )


def _security_schemes() -> dict[str, Any]:
    return {
        "bearer": {"type": "http", "scheme": "bearer", "description": "The proxy's --api-key ($KVOFFLOAD_API_KEY)."},
        "metaserverToken": {
            "type": "http",
            "scheme": "bearer",
            "description": "Decoders only: kv_transfer_params.metaserver_token of "
            "the request being registered (issued per request).",
        },
    }


def build_openapi(api_key_required: bool) -> dict[str, Any]:
    components = _base_components()
    errors = _error_responses(_GENERATE_ERRORS)
    paths = _paths(components, errors, api_key_required)
    if api_key_required:
        _require_keys(paths, errors)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "kvoffload proxy",
            "version": __version__,
            "description": "OpenAI-compatible front door of kvoffload's layerwise P/D deployment (decode first).",
        },
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key_required:
        doc["components"]["securitySchemes"] = _security_schemes()
    return doc
