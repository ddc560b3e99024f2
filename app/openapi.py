"""The OpenAPI 3 document served at ``/v1/openapi.json``."""

from __future__ import annotations

from typing import Any


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def _run(description: str, headers: dict | None = None) -> dict[str, Any]:
    out = {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Run"}}},
    }
    if headers:
        out["headers"] = headers
    return out


AUTH_ERRORS = {
    "401": _error("Missing, invalid or revoked token"),
    "403": _error("The token may not act for the tenant named in X-Poimen-Tenant"),
}


def openapi_document() -> dict[str, Any]:
    """Return the OpenAPI 3.0 description of the ``/v1`` API."""
    tenant_header = {
        "name": "X-Poimen-Tenant",
        "in": "header",
        "required": False,
        "description": "With a service token: the tenant to act for.",
        "schema": {"type": "string"},
    }
    run_id = {"name": "run_id", "in": "path", "required": True,
              "schema": {"type": "string", "format": "uuid"}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "Poimen", "version": "1",
                 "description": "Runs admitted exactly once, executed by Celery workers."},
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "paths": {
            "/v1/runs": {
                "post": {
                    "operationId": "createRun",
                    "summary": "Admit a run (idempotent per dispatch_key)",
                    "parameters": [tenant_header],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {
                            "schema": {"$ref": "#/components/schemas/RunRequest"}}},
                    },
                    "responses": {
                        "201": _run("A new run was admitted", {
                            "Location": {"schema": {"type": "string"}}}),
                        "200": _run("Replay: the run this dispatch_key already admitted", {
                            "Idempotent-Replayed": {"schema": {"type": "string",
                                                               "enum": ["true"]}},
                            "Location": {"schema": {"type": "string"}}}),
                        "400": _error("Malformed JSON, or a body that is not an object"),
                        **AUTH_ERRORS,
                        "404": _error("The tenant named in X-Poimen-Tenant does not exist"),
                        "409": _error("dispatch_key already admitted a different request; "
                                      "details.run_id names the existing run"),
                        "413": _error("Body over 1 MiB"),
                        "415": _error("Body is not application/json"),
                        "422": _error("Invalid fields, or an unknown workflow_ref"),
                    },
                },
                "get": {
                    "operationId": "listRuns",
                    "summary": "List runs, newest first, cursor-paginated",
                    "parameters": [
                        tenant_header,
                        {"name": "status", "in": "query", "schema": {"type": "string"},
                         "description": "Comma list of statuses"},
                        {"name": "goal_id", "in": "query", "schema": {"type": "string"}},
                        {"name": "workflow_ref", "in": "query", "schema": {"type": "string"}},
                        {"name": "dispatch_key", "in": "query", "schema": {"type": "string"}},
                        {"name": "limit", "in": "query",
                         "schema": {"type": "integer", "minimum": 1, "maximum": 200,
                                    "default": 50}},
                        {"name": "cursor", "in": "query", "schema": {"type": "string"}},
                    ],
                    "responses": {
                        "200": {"description": "A page of runs", "content": {
                            "application/json": {"schema": {
                                "type": "object",
                                "required": ["runs", "next_cursor"],
                                "properties": {
                                    "runs": {"type": "array",
                                             "items": {"$ref": "#/components/schemas/Run"}},
                                    "next_cursor": {"type": "string", "nullable": True},
                                }}}}},
                        "400": _error("Invalid filter, limit or cursor"),
                        **AUTH_ERRORS,
                    },
                },
            },
            "/v1/runs/{run_id}": {
                "get": {
                    "operationId": "getRun",
                    "parameters": [run_id, tenant_header],
                    "responses": {"200": _run("The run"), **AUTH_ERRORS,
                                  "404": _error("No such run for this tenant")},
                }
            },
            "/v1/runs/{run_id}/cancel": {
                "post": {
                    "operationId": "cancelRun",
                    "summary": "Cancel a queued run, or ask a running one to stop",
                    "parameters": [run_id, tenant_header],
                    "responses": {
                        "200": _run("Cancelled, or already finished (unchanged)"),
                        "202": _run("Running: cancellation requested"),
                        **AUTH_ERRORS,
                        "404": _error("No such run for this tenant"),
                    },
                }
            },
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "RunRequest": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["workflow_ref"],
                    "properties": {
                        "workflow_ref": {"type": "string", "minLength": 1, "maxLength": 200,
                                         "description": "'name' or 'name@version'"},
                        "input": {"type": "object", "default": {}},
                        "goal_id": {"type": "string", "minLength": 1, "maxLength": 255,
                                    "nullable": True},
                        "dispatch_key": {"type": "string", "minLength": 1, "maxLength": 255,
                                         "nullable": True},
                    },
                },
                "Run": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "tenant": {"type": "string"},
                        "workflow_ref": {"type": "string"},
                        "workflow": {"type": "object", "properties": {
                            "name": {"type": "string"}, "version": {"type": "string"}}},
                        "input": {"type": "object"},
                        "goal_id": {"type": "string", "nullable": True},
                        "dispatch_key": {"type": "string", "nullable": True},
                        "status": {"type": "string", "enum": ["queued", "running", "succeeded",
                                                              "failed", "cancelled"]},
                        "attempt": {"type": "integer"},
                        "cancel_requested": {"type": "boolean"},
                        "result": {"nullable": True},
                        "error": {"type": "object", "nullable": True},
                        "origin": {"type": "string", "enum": ["http", "fanout", "internal"]},
                        "parent_run_id": {"type": "string", "nullable": True},
                        "created_at": {"type": "string", "format": "date-time"},
                        "updated_at": {"type": "string", "format": "date-time"},
                        "started_at": {"type": "string", "format": "date-time",
                                       "nullable": True},
                        "finished_at": {"type": "string", "format": "date-time",
                                        "nullable": True},
                    },
                },
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {"error": {
                        "type": "object",
                        "required": ["code", "message", "details"],
                        "properties": {"code": {"type": "string"},
                                       "message": {"type": "string"},
                                       "details": {"type": "object"}},
                    }},
                },
            },
        },
    }
