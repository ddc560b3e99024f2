"""The OpenAPI 3 document served at ``/v1/openapi.json``."""

from __future__ import annotations

from typing import Any

from .models import AdmissionOrigin, RunStatus, WaitReason


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


TENANT_REQUIRED = "a service token sent without X-Poimen-Tenant"
TENANT_NOT_FOUND = "the tenant named in X-Poimen-Tenant (service token) does not exist"


SCOPE_FORBIDDEN = ("the token's scope does not allow this operation (an 'admit'-scoped "
                   "token, such as the Kafka inbox's, may only POST /v1/runs)")


def _auth_errors(bad_request: str | None = None, not_found: str | None = None,
                 scoped: bool = True) -> dict[str, Any]:
    """The answers every authenticated operation may give, merged with its own 400 and 404.

    ``scoped``: an ``admit``-scoped token is refused here (403).
    """
    unauthorized = _error("Missing, invalid or revoked token")
    unauthorized["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    def sentence(*parts: str | None) -> str:
        text = "; or ".join(filter(None, parts))
        return text[0].upper() + text[1:]

    unavailable = _error("database_unavailable: the database is not reachable (a restart, a "
                         "failover); retry after Retry-After seconds, with the same "
                         "dispatch_key for an admission")
    unavailable["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return {
        "503": unavailable,
        "400": _error(sentence(bad_request, TENANT_REQUIRED)),
        "401": unauthorized,
        "403": _error(sentence("the token may not act for the tenant named in X-Poimen-Tenant",
                               SCOPE_FORBIDDEN if scoped else None)),
        "404": _error(sentence(not_found, TENANT_NOT_FOUND)),
    }


RUN_FIELDS = [
    "id", "tenant", "workflow_ref", "workflow", "input", "goal_id", "dispatch_key",
    "key_released", "status", "wait_reason", "concurrency_key", "attempt", "cancel_requested",
    "result", "error", "origin", "parent_run_id", "traceparent", "created_at", "updated_at",
    "started_at", "finished_at", "not_before", "expires_at",
]

CANCELLED_DESCENDANTS = {"Poimen-Cancelled-Descendants": {
    "description": "How many of the run's descendants this cancel cancelled or asked to "
                   "stop (0 with cascade=false)",
    "schema": {"type": "integer", "minimum": 0}}}

TRACEPARENT = "^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"


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
    run_request = {
        "type": "object",
        "additionalProperties": False,
        "required": ["workflow_ref"],
        "properties": {
            "workflow_ref": {"type": "string", "minLength": 1, "maxLength": 200,
                             "pattern": "\\S",
                             "description": "'name' or 'name@version' of a "
                                            "registered workflow"},
            "input": {"type": "object", "default": {}},
            "goal_id": {"type": "string", "minLength": 1, "maxLength": 255,
                        "nullable": True},
            "dispatch_key": {"type": "string", "minLength": 1, "maxLength": 255,
                             "nullable": True},
            "concurrency_key": {
                "type": "string", "minLength": 1, "maxLength": 255,
                "nullable": True,
                "description": "The run's concurrency group within its workflow "
                               "(default: the workflow's concurrency_key(input), "
                               "else none); a workflow with a concurrency_limit "
                               "runs at most that many runs of one key at once"},
            "not_before": {
                "type": "string", "format": "date-time", "nullable": True,
                "description": "Delay: the run starts no earlier (RFC 3339 with an offset, "
                               "within a year of now). It waits in Postgres and beat sends "
                               "it when due (no Celery ETA). A replay must name the same "
                               "instant. Not with delay_seconds"},
            "delay_seconds": {
                "type": "number", "minimum": 0, "maximum": 31622400, "nullable": True,
                "description": "Delay: seconds from admission (Postgres's clock). A replay "
                               "compares only that it is delayed (the time counts from the "
                               "first admission). Not with not_before"},
            "expires_at": {
                "type": "string", "format": "date-time", "nullable": True,
                "description": "A run no worker started by then ends expired (a terminal "
                               "status, event run.expired), wherever it waits: in Redis, "
                               "for a slot, or delayed. A started run is not expired. A "
                               "replay must name the same instant. Not with "
                               "expires_in_seconds"},
            "expires_in_seconds": {
                "type": "number", "minimum": 0, "maximum": 31622400, "nullable": True,
                "description": "Expiry in seconds from admission. A replay compares only "
                               "that it expires. Not with expires_at"},
        },
    }
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
                    "parameters": [tenant_header, {
                        "name": "Idempotency-Key", "in": "header", "required": False,
                        "description": "The same as the body's dispatch_key (IETF draft "
                                       "Idempotency-Key header); both present and different "
                                       "is a 422. A quoted value is unquoted.",
                        "schema": {"type": "string", "minLength": 1, "maxLength": 257}}, {
                        "name": "traceparent", "in": "header", "required": False,
                        "description": "W3C Trace Context: kept on a new run, sent with its "
                                       "Celery messages and on every event of the run "
                                       "(ce_traceparent); a fan-out child inherits it. A "
                                       "malformed value is ignored, never an error; a replay "
                                       "keeps the first run's.",
                        "schema": {"type": "string", "maxLength": 512}}, {
                        "name": "tracestate", "in": "header", "required": False,
                        "description": "W3C Trace Context: kept with a valid traceparent when "
                                       "well formed (at most 32 members, 512 characters), "
                                       "else ignored.",
                        "schema": {"type": "string", "maxLength": 512}}],
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
                        **_auth_errors("malformed JSON, or a body that is not an object",
                                       scoped=False),
                        "409": _error("dispatch_key already admitted a different request; "
                                      "details.run_id names the existing run"),
                        "413": _error("Body over 1 MiB"),
                        "415": _error("Body is not application/json"),
                        "422": _error("Invalid fields, an unknown workflow_ref, or an input "
                                      "that cannot be stored as sent (U+0000, an unpaired "
                                      "surrogate, a number such as 1e400 that is not finite "
                                      "as a double)"),
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
                        {"name": "parent_run_id", "in": "query",
                         "schema": {"type": "string", "format": "uuid"},
                         "description": "Only the children of this run (admitted by its "
                                        "fan-outs)"},
                        {"name": "limit", "in": "query",
                         "schema": {"type": "integer", "minimum": 1, "maximum": 200,
                                    "default": 50}},
                        {"name": "cursor", "in": "query",
                         "schema": {"type": "string", "maxLength": 512},
                         "description": "next_cursor of the previous page"},
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
                        **_auth_errors("an unknown parameter, or an invalid status, limit, "
                                       "parent_run_id or cursor (one this API did not issue, "
                                       "or longer than 512 characters)"),
                    },
                },
            },
            "/v1/runs/batch": {
                "post": {
                    "operationId": "createRuns",
                    "summary": "Admit many runs at once, each as POST /v1/runs would alone",
                    "description": "Answers 200 with one result per item, in request order: "
                                   "201 and the run (created), 200 and the run (a replay, "
                                   "also for an item repeating an earlier item's "
                                   "dispatch_key), or the status and error the single "
                                   "endpoint would give that item alone (400, 409, 422). A "
                                   "bad item never fails its neighbours. At most "
                                   "POIMEN_BATCH_MAX items (1000 by default).",
                    "parameters": [tenant_header, {
                        "name": "Idempotency-Key", "in": "header", "required": False,
                        "description": "Not accepted on a batch (a 422): send dispatch_key "
                                       "per item.",
                        "schema": {"type": "string"}}],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["runs"],
                            "properties": {"runs": {
                                "type": "array",
                                "items": {"$ref": "#/components/schemas/BatchRunRequest"}}},
                        }}},
                    },
                    "responses": {
                        "200": {"description": "One result per item, in request order",
                                "content": {"application/json": {"schema": {
                                    "type": "object",
                                    "required": ["results"],
                                    "properties": {"results": {
                                        "type": "array",
                                        "items": {"$ref": "#/components/schemas/BatchResult"},
                                    }}}}}},
                        **_auth_errors("malformed JSON, or a body that is not an object",
                                       scoped=False),
                        "413": _error("Body over 1 MiB, or batch_too_large: more items than "
                                      "POIMEN_BATCH_MAX (details: max, given); nothing is "
                                      "admitted"),
                        "415": _error("Body is not application/json"),
                        "422": _error("The body has no runs array (or other fields), or an "
                                      "Idempotency-Key header was sent"),
                    },
                },
            },
            "/v1/runs/{run_id}": {
                "get": {
                    "operationId": "getRun",
                    "parameters": [run_id, tenant_header, {
                        "name": "wait", "in": "query", "required": False,
                        "description": "Seconds to wait on the server for the run to end "
                                       "(at most POIMEN_WAIT_MAX_SECONDS, 60): answered as "
                                       "soon as it ends, else with the run as it is once "
                                       "they pass. A waiting request holds no database "
                                       "connection; beyond POIMEN_WAIT_MAX waiters per "
                                       "gunicorn worker the answer comes at once, with "
                                       "Poimen-Wait: full (poll then)",
                        "schema": {"type": "number", "minimum": 0, "maximum": 60}}],
                    "responses": {"200": {"description": "The run, with its step entries",
                                          "headers": {"Poimen-Wait": {
                                              "description": "full: the wait was not "
                                                             "served (too many waiting)",
                                              "schema": {"type": "string",
                                                         "enum": ["full"]}}},
                                          "content": {"application/json": {"schema": {
                                              "$ref": "#/components/schemas/RunWithSteps"}}}},
                                  **_auth_errors(not_found="no such run for this tenant",
                                                 bad_request="an unknown query parameter, "
                                                             "or wait out of range")},
                }
            },
            "/v1/runs/{run_id}/cancel": {
                "post": {
                    "operationId": "cancelRun",
                    "summary": "Cancel a queued run, or ask a running one to stop; and its "
                               "descendants",
                    "parameters": [run_id, tenant_header, {
                        "name": "cascade", "in": "query", "required": False,
                        "description": "true (the default): the cancel reaches every "
                                       "descendant not ended (fan-out children, theirs, "
                                       "...), each with its event, and a child admitted "
                                       "under the run afterwards is admitted cancelled; "
                                       "false: the run alone",
                        "schema": {"type": "string", "enum": ["true", "false"],
                                   "default": "true"}}],
                    "responses": {
                        "200": _run("Cancelled, or already finished (unchanged)",
                                    CANCELLED_DESCENDANTS),
                        "202": _run("Running: cancellation requested", CANCELLED_DESCENDANTS),
                        **_auth_errors(not_found="no such run for this tenant",
                                       bad_request="an unknown query parameter, or cascade "
                                                   "not true or false"),
                    },
                }
            },
            "/v1/openapi.json": {
                "get": {
                    "operationId": "getOpenApiDocument",
                    "summary": "This document",
                    "security": [],
                    "responses": {"200": {"description": "The OpenAPI document", "content": {
                        "application/json": {"schema": {"type": "object"}}}}},
                }
            },
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "RunRequest": run_request,
                "BatchRunRequest": {
                    **run_request,
                    "properties": {
                        **run_request["properties"],
                        "traceparent": {
                            "type": "string", "nullable": True,
                            "description": "W3C Trace Context of this item, as the "
                                           "traceparent header of POST /v1/runs: kept on a "
                                           "new run when valid, ignored (never an error) if "
                                           "not"},
                        "tracestate": {"type": "string", "nullable": True,
                                       "description": "W3C Trace Context of this item, "
                                                      "as the tracestate header"},
                    },
                },
                "BatchResult": {
                    "type": "object",
                    "required": ["status"],
                    "properties": {
                        "status": {"type": "integer", "enum": [200, 201, 400, 409, 422]},
                        "run": {"$ref": "#/components/schemas/Run"},
                        "error": {
                            "type": "object",
                            "required": ["code", "message", "details"],
                            "properties": {"code": {"type": "string"},
                                           "message": {"type": "string"},
                                           "details": {"type": "object"}}},
                    },
                },
                "Run": {
                    "type": "object",
                    "required": RUN_FIELDS,
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "tenant": {"type": "string"},
                        "workflow_ref": {"type": "string"},
                        "workflow": {"type": "object", "required": ["name", "version"],
                                     "properties": {"name": {"type": "string"},
                                                    "version": {"type": "string"}}},
                        "input": {"type": "object"},
                        "goal_id": {"type": "string", "nullable": True},
                        "dispatch_key": {"type": "string", "nullable": True},
                        "key_released": {
                            "type": "boolean",
                            "description": "true once a newer run took this run's "
                                           "dispatch_key (the workflow's key_reuse policy); "
                                           "a replay of the key answers with the newer run"},
                        "status": {"type": "string", "enum": [s.value for s in RunStatus],
                                   "description": "succeeded, failed, cancelled, poisoned "
                                                  "and expired are terminal; poisoned: the "
                                                  "run's executions killed its workflow's "
                                                  "max_takeovers + 1 workers, and it was not "
                                                  "resumed again (error.code poisoned); "
                                                  "expired: no worker started it by its "
                                                  "expires_at"},
                        "wait_reason": {"type": "string", "nullable": True,
                                        "enum": [*(r.value for r in WaitReason), None],
                                        "description": "What a waiting run waits for; "
                                                       "rate_limit: a queued run's start, "
                                                       "reserved by its rate limits for "
                                                       "not_before"},
                        "concurrency_key": {"type": "string", "nullable": True},
                        "attempt": {"type": "integer"},
                        "cancel_requested": {"type": "boolean"},
                        "result": {"nullable": True},
                        "error": {"type": "object", "nullable": True},
                        "origin": {"type": "string", "enum": [o.value for o in AdmissionOrigin]},
                        "parent_run_id": {"type": "string", "format": "uuid",
                                          "nullable": True},
                        "traceparent": {"type": "string", "pattern": TRACEPARENT,
                                        "nullable": True,
                                        "description": "The W3C traceparent the run was "
                                                       "admitted with (version 00)"},
                        "created_at": {"type": "string", "format": "date-time"},
                        "updated_at": {"type": "string", "format": "date-time"},
                        "started_at": {"type": "string", "format": "date-time",
                                       "nullable": True},
                        "finished_at": {"type": "string", "format": "date-time",
                                        "nullable": True},
                        "not_before": {"type": "string", "format": "date-time",
                                       "nullable": True,
                                       "description": "Not started before this time (a "
                                                      "delayed admission's, or a retry's)"},
                        "expires_at": {"type": "string", "format": "date-time",
                                       "nullable": True,
                                       "description": "Ends expired if no worker started it "
                                                      "by then"},
                    },
                },
                "RunWithSteps": {
                    "allOf": [
                        {"$ref": "#/components/schemas/Run"},
                        {"type": "object", "required": ["steps"], "properties": {
                            "steps": {"type": "array",
                                      "items": {"$ref": "#/components/schemas/StepEntry"}}}},
                    ],
                },
                "StepEntry": {
                    "type": "object",
                    "description": "One entry of the run into a step (the step-entry ledger).",
                    "required": ["entry", "step", "status", "next_step", "error", "children",
                                 "started_at", "finished_at", "actions"],
                    "properties": {
                        "entry": {"type": "integer", "minimum": 1},
                        "step": {"type": "string"},
                        "status": {"type": "string", "enum": [
                            "running", "waiting", "completed", "failed", "abandoned"]},
                        "next_step": {"type": "string", "nullable": True},
                        "error": {"type": "object", "nullable": True},
                        "children": {"type": "object", "required": ["total", "done"],
                                     "properties": {"total": {"type": "integer"},
                                                    "done": {"type": "integer"}}},
                        "started_at": {"type": "string", "format": "date-time"},
                        "finished_at": {"type": "string", "format": "date-time",
                                        "nullable": True},
                        "actions": {"type": "array", "items": {
                            "type": "object",
                            "required": ["position", "name", "marker", "status", "outcome"],
                            "properties": {
                                "position": {"type": "integer", "minimum": 0},
                                "name": {"type": "string"},
                                "marker": {"type": "boolean"},
                                "status": {"type": "string", "enum": [
                                    "pending", "claimed", "completed", "failed", "lost",
                                    "abandoned"]},
                                "outcome": {"nullable": True,
                                            "description": "The output, or the error"},
                                "claims": {"type": "integer", "minimum": 1,
                                           "description": "Marker-bearing only: how many "
                                                          "boots claimed it (over 1: taken "
                                                          "over from a dead worker)"},
                            },
                        }},
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
