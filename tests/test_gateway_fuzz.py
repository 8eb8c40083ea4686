"""Property-based fuzzing of `ember serve` from its own OpenAPI document (schemathesis).

One gateway serves the whole module. Every documented operation gets generated
requests, valid ones and invalid ones, sent over real HTTP with a valid key; each
response must not be a 5xx and must match the document: status code, content
type, headers and body. The model server answers every turn at once.

Cases come from `operation.as_strategy()` under a plain `hypothesis.given`, one
pytest test per operation: schemathesis's own pytest integration
(`schema.parametrize()` on a lazy schema) fails under pytest 9 ("'Function' object
has no attribute '_nodeid'"). `derandomize` makes every run send the same requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.openapi.checks import JsonSchemaError, UndefinedStatusCode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.specs.openapi.schemas import OpenApiSchema

from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.modelserver import ModelServer, Reply, serving

SECRET = "fuzzer-secret-0123456789"
AUTH = {"Authorization": f"Bearer {SECRET}"}
EXAMPLES = 25
CHAT = ("POST", "/v1/chat/completions")
HISTORY_GET = ("GET", "/api/sessions/{key}/messages")
HISTORY_POST = ("POST", "/api/sessions/{key}/messages")
APPROVE = ("POST", "/api/approvals/{id}")
MEMORY_LIST = ("GET", "/api/memory")
MEMORY_ADD = ("POST", "/api/memory")
MEMORY_SEARCH = ("GET", "/api/memory/search")
MEMORY_FORGET = ("DELETE", "/api/memory/{id}")
MEMORY_CORRECT = ("PATCH", "/api/memory/{id}")
STOP = ("POST", "/api/sessions/{key}/stop")
OPERATIONS = [CHAT, ("GET", "/v1/models"), ("GET", "/api/sessions"), HISTORY_GET, HISTORY_POST, STOP,
              ("GET", "/api/approvals"), APPROVE, MEMORY_LIST, MEMORY_ADD, MEMORY_SEARCH, MEMORY_FORGET,
              MEMORY_CORRECT, ("GET", "/healthz"), ("GET", "/metrics")]
# Operations with inputs: only they have invalid requests to generate.
WITH_INPUTS = [CHAT, HISTORY_GET, HISTORY_POST, STOP, APPROVE, MEMORY_LIST, MEMORY_ADD, MEMORY_SEARCH, MEMORY_FORGET,
               MEMORY_CORRECT]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection, positive_data_acceptance, ignored_auth]


def fuzz_settings(examples: int = EXAMPLES) -> Callable[[Any], Any]:
    """Bounded and reproducible: the same examples on every run, nothing remembered between runs."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with serving() as server:
        server.responder = lambda body: Reply(text="fuzzed answer")
        yield server


@pytest.fixture(scope="module")
def gateway(model: ModelServer, launch_module_gateway: LaunchGateway) -> GatewayProcess:
    return launch_module_gateway(model, keys={"fuzzer": SECRET},
                                 EMBER_GATEWAY_RATE_PER_MINUTE="1000000", EMBER_GATEWAY_RATE_BURST="1000000")


@pytest.fixture(scope="module")
def served_document(gateway: GatewayProcess) -> dict[str, Any]:
    response = httpx.get(gateway.url("/openapi.json"), headers=AUTH, timeout=10)
    response.raise_for_status()
    document: dict[str, Any] = response.json()
    return document


def load(document: dict[str, Any], gateway: GatewayProcess) -> OpenApiSchema:
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(base_url=gateway.base_url)
    return schema


@pytest.fixture(scope="module")
def served_schema(served_document: dict[str, Any], gateway: GatewayProcess) -> OpenApiSchema:
    return load(served_document, gateway)


def fuzz(schema: OpenApiSchema, operation: tuple[str, str], mode: GenerationMode, *,
         checks: list[Callable[..., Any]], examples: int = EXAMPLES) -> list[FailureGroup]:
    """Send generated requests of one operation; the failures the checks found."""
    method, path = operation
    failures: list[FailureGroup] = []

    @fuzz_settings(examples)
    @given(case=schema[path][method].as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        # HTTP trims the spaces around a header value: " k " arrives as the valid "k".
        session = (case.headers or {}).get("X-Ember-Session")
        assume(session is None or session == session.strip(" \t"))
        response = case.call(headers=AUTH, timeout=30)
        try:
            case.validate_response(response, checks=checks, headers=AUTH)
        except FailureGroup as group:
            failures.append(group)

    run()
    return failures


def report(failures: list[FailureGroup]) -> str:
    return "\n\n".join(str(group) for group in failures[:3])


def kinds(failures: list[FailureGroup]) -> set[type[BaseException]]:
    return {type(failure) for group in failures for failure in group.exceptions}


def test_document_lists_every_fuzzed_operation(served_document: dict[str, Any]) -> None:
    documented = {(method.upper(), path) for path, item in served_document["paths"].items() for method in item}
    assert documented == set(OPERATIONS)


@pytest.mark.parametrize("operation", OPERATIONS, ids=" ".join)
def test_valid_requests_are_served_as_documented(served_schema: OpenApiSchema, operation: tuple[str, str]) -> None:
    # The chat route needs its last user message to have text, which JSON Schema cannot say: see the end.
    # And a file sent with a message must be what its bytes say (a PNG, a PDF, UTF-8 text), which it
    # cannot say either: tests/test_attachments.py checks what is refused, and how.
    checks = [c for c in CHECKS if not (operation in (CHAT, HISTORY_POST) and c is positive_data_acceptance)]
    failures = fuzz(served_schema, operation, GenerationMode.POSITIVE, checks=checks)
    assert not failures, report(failures)


@pytest.mark.parametrize("operation", WITH_INPUTS, ids=" ".join)
def test_invalid_requests_are_rejected_as_documented(served_schema: OpenApiSchema,
                                                     operation: tuple[str, str]) -> None:
    failures = fuzz(served_schema, operation, GenerationMode.NEGATIVE, checks=CHECKS)
    assert not failures, report(failures)


def test_gateway_still_answers_after_the_fuzz(gateway: GatewayProcess, model: ModelServer) -> None:
    response = httpx.post(gateway.url("/v1/chat/completions"), headers=AUTH, timeout=30,
                          json={"model": "ember", "messages": [{"role": "user", "content": "still there?"}]})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "fuzzed answer"
    assert gateway.process.poll() is None
    # The fuzz reached the model: generated requests made real turns, not only rejections.
    assert len(model.requests) > 10
    # And the memory: generated memories were stored, not only rejected.
    assert httpx.get(gateway.url("/api/memory"), headers=AUTH, timeout=30).json()


# What the document says of the stream, the errors and the chat body.


def test_document_lists_400_for_an_invalid_history_key(served_schema: OpenApiSchema) -> None:
    failures = fuzz(served_schema, HISTORY_GET, GenerationMode.NEGATIVE, checks=[status_code_conformance])
    assert UndefinedStatusCode not in kinds(failures), report(failures)


def test_document_describes_the_native_stream_events(served_schema: OpenApiSchema) -> None:
    failures = fuzz(served_schema, HISTORY_POST, GenerationMode.POSITIVE, checks=[response_schema_conformance],
                    examples=5)
    assert JsonSchemaError not in kinds(failures), report(failures)


# Bodies the chat route rejects with 400 that the document could rule out. (That the *last* user
# message must have text, JSON Schema cannot say: the fuzz above skips that check for the route.)
REJECTED_CHAT_BODIES = {
    "no user message": {"model": "ember", "messages": [{"role": "system", "content": "be brief"}]},
    "user field not a session key": {"model": "ember", "messages": [{"role": "user", "content": "hi"}],
                                     "user": "not/a key"},
}


@pytest.mark.parametrize("body", list(REJECTED_CHAT_BODIES.values()), ids=list(REJECTED_CHAT_BODIES))
def test_document_rules_out_chat_bodies_the_route_rejects(gateway: GatewayProcess, served_document: dict[str, Any],
                                                          body: dict[str, Any]) -> None:
    response = httpx.post(gateway.url("/v1/chat/completions"), headers=AUTH, json=body, timeout=30)
    assert response.status_code == 400, response.text
    request_schema = {"$ref": "#/components/schemas/ChatCompletionRequest",
                      "components": served_document["components"]}
    assert not jsonschema_rs.Draft202012Validator(request_schema).is_valid(body)
