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


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_error_and_no_schema_violation(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=[not_a_server_error, response_schema_conformance, content_type_conformance])
