"""Hostile input: schemathesis generates requests from the gateway's own OpenAPI document (valid and
invalid bodies, odd parameters) and checks that none is answered with a 5xx and that every answer
matches the document's schema and content types.

Bounded (a few examples per operation, no deadline) so CI stays fast; the synthesizer is the ops test
double, so this pins the HTTP layer, not the models.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from gateway.app import create_app
from gateway.settings import Settings
from tests.support.ops_double import OpsSynthesizer

app = create_app(Settings(), OpsSynthesizer())
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


def steer_into_the_pipeline(case: schemathesis.Case) -> None:
    """The document cannot say which model ids and voices exist, so most generated speech bodies
    would stop at "model not found". Where the generated field is a string, name a real model and
    voice (and non-empty input) so the fuzzed remainder reaches synthesis and streaming too."""
    body = case.body
    if case.method == "POST" and case.path == "/v1/audio/speech" and isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = "tts-1"
        if isinstance(body.get("voice"), str):
            body["voice"] = "alloy"
        if body.get("input") == "":
            body["input"] = "hello"


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_error_and_no_schema_violation(case: schemathesis.Case) -> None:
    steer_into_the_pipeline(case)
    case.call_and_validate(checks=[not_a_server_error, response_schema_conformance, content_type_conformance])
