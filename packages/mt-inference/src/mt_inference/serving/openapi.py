"""The OpenAPI 3.0 description of what one `mt serve` accepts and answers (``GET
/openapi.json``): its limits (positions, vocabulary, prompts, new tokens) are the running
server's, so a client, a generator of tests (schemathesis) or a reader sees the real bounds.
:func:`mt_inference.serving.api.parse_completion` is the rule; this is its description, and a
test holds the two to each other."""

from __future__ import annotations

from typing import Any

from mt_inference.serving.api import Limits
from mt_model import SEED_MAX

__all__ = ["openapi_schema"]


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


def _request(limits: Limits) -> dict[str, Any]:
    text = {"type": "string", "minLength": 1}
    ids = {"type": "array", "minItems": 1, "maxItems": limits.max_positions - 1,
           "items": {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}}
    many = {"type": "array", "minItems": 1, "maxItems": limits.max_prompts}
    zero = {"type": "number", "minimum": 0, "maximum": 0}
    return {
        "type": "object", "additionalProperties": False, "required": ["prompt"],
        "properties": {
            "model": _nullable({"type": "string"}),
            "prompt": {"description": "a string, a list of strings, a list of token ids or "
                       "a list of such lists (each must fit the model's positions with "
                       "max_tokens; else 400)",
                       "anyOf": [text, ids, {**many, "items": {"anyOf": [text, ids]}}]},
            "max_tokens": _nullable({"type": "integer", "minimum": 1,
                                     "maximum": limits.token_cap}),
            "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
            "top_p": _nullable({"type": "number", "exclusiveMinimum": True, "minimum": 0,
                                "maximum": 1}),
            "top_k": _nullable({"type": "integer", "minimum": 0,
                                "maximum": limits.vocab_size}),
            "stop": _nullable({"anyOf": [text, {"type": "array", "maxItems": 4,
                                                "items": text}]}),
            "seed": _nullable({"type": "integer", "minimum": 0, "maximum": SEED_MAX}),
            "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 5}),
            "echo": _nullable({"type": "boolean"}),
            "stream": _nullable({"type": "boolean"}),
            "stream_options": _nullable({
                "type": "object", "additionalProperties": False,
                "description": "include_usage: true only with stream: true",
                "properties": {"include_usage": _nullable({"type": "boolean"})}}),
            "n": _nullable({"type": "integer", "minimum": 1, "maximum": limits.max_prompts,
                            "description": "prompts x n must not exceed "
                            f"{limits.max_prompts}"}),
            "user": _nullable({"type": "string"}),
            "presence_penalty": _nullable(zero),
            "frequency_penalty": _nullable(zero),
            "best_of": _nullable({"type": "integer", "minimum": 1, "maximum": 1}),
            "suffix": _nullable({"type": "string", "maxLength": 0}),
            "logit_bias": _nullable({"type": "object", "maxProperties": 0}),
        },
    }


_LOGPROBS = _nullable({"type": "object", "required": ["tokens", "token_logprobs",
                                                      "top_logprobs", "text_offset"],
                       "properties": {
                           "tokens": {"type": "array", "items": {"type": "string"}},
                           "token_logprobs": {"type": "array",
                                              "items": _nullable({"type": "number"})},
                           "top_logprobs": {"type": "array", "items": _nullable(
                               {"type": "object",
                                "additionalProperties": {"type": "number"}})},
                           "text_offset": {"type": "array", "items": {"type": "integer"}}}})

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer", "minimum": 0} for k in
                         ("prompt_tokens", "completion_tokens", "total_tokens")}}

_COMPLETION = {
    "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]},
        "created": {"type": "integer"}, "model": {"type": "string"},
        "choices": {"type": "array", "items": {
            "type": "object", "required": ["index", "text", "logprobs", "finish_reason"],
            "properties": {"index": {"type": "integer", "minimum": 0},
                           "text": {"type": "string"}, "logprobs": _LOGPROBS,
                           "finish_reason": {"type": "string",
                                             "enum": ["stop", "length"]}}}},
        "usage": _USAGE}}

_EVENT = {"type": "object", "required": ["data"], "description": "one server-sent event: its "
          "data a completion chunk (JSON), an error object, or [DONE] to end",
          "properties": {"data": {"type": "string", "minLength": 1},
                         "event": {"type": "string"}}}

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": _nullable({"type": "string"}),
                   "code": _nullable({"type": "string"})}}}}

_MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"],
          "properties": {"id": {"type": "string"}, "object": {"type": "string",
                                                               "enum": ["model"]},
                         "created": {"type": "integer"}, "owned_by": {"type": "string"},
                         "max_model_len": {"type": "integer"}}}


def _errors(*statuses: int) -> dict[str, Any]:
    why = {400: "a field at fault (named in param)", 401: "a missing or wrong API key",
           404: "no such model", 405: "another method", 413: "a body over the limit",
           429: "the queue is full (Retry-After)", 499: "the client went away",
           500: "decoding failed for this request (the server goes on)",
           503: "the server is draining", 504: "the request ran past its time"}
    return {str(s): {"description": why[s], "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"}}}} for s in statuses}


def openapi_schema(model: str, limits: Limits, keyed: bool) -> dict[str, Any]:
    """The OpenAPI document of a server serving ``model`` under ``limits`` (``keyed``: the
    /v1 routes need ``Authorization: Bearer KEY``)."""
    secured = {"security": [{"bearer": []}]} if keyed else {}
    auth = (401,) if keyed else ()
    completions = {
        "summary": "Complete prompts (OpenAI's completions API)", **secured,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/CompletionRequest"}}}},
        "responses": {"200": {"description": "the completion (server-sent events with "
                              "stream: true, ending in data: [DONE])", "content": {
                                  "application/json": {"schema": {
                                      "$ref": "#/components/schemas/Completion"}},
                                  "text/event-stream": {"schema": _EVENT}}},
                      **_errors(400, *auth, 404, 405, 413, 429, 499, 500, 503, 504)}}
    model_ok = {"description": "the model", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Model"}}}}
    health = {"type": "object", "required": ["status"], "properties": {
        "status": {"type": "string"}, "waiting": {"type": "integer"},
        "running": {"type": "integer"}, "gone": {"type": "integer"}}}
    document: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": "mt serve", "version": "1",
                 "description": f"OpenAI's completions API over '{model}' "
                 f"({limits.max_positions} positions, vocabulary {limits.vocab_size})"},
        "paths": {
            "/v1/completions": {"post": completions},
            "/v1/models": {"get": {**secured, "summary": "The served model", "responses": {
                "200": {"description": "the list", "content": {"application/json": {
                    "schema": {"type": "object", "required": ["object", "data"],
                               "properties": {"object": {"type": "string"},
                                              "data": {"type": "array", "items": {
                                                  "$ref": "#/components/schemas/Model"}}}}}}},
                **_errors(*auth, 405)}}},
            "/v1/models/{model}": {"get": {
                **secured, "summary": "One model (404 unless it is the served one)",
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {"200": model_ok, **_errors(*auth, 404, 405)}}},
            "/health": {"get": {"summary": "Liveness (no key needed)", "responses": {
                "200": {"description": "serving", "content": {"application/json": {
                    "schema": health}}},
                "503": {"description": "draining", "content": {"application/json": {
                    "schema": health}}}, **_errors(405)}}},
        },
        "components": {"schemas": {"CompletionRequest": _request(limits),
                                   "Completion": _COMPLETION, "Error": _ERROR,
                                   "Model": _MODEL}},
    }
    if keyed:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                                "scheme": "bearer"}}
    return document
