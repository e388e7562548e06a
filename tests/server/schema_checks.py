"""Schemathesis hooks for the fuzz run (SCHEMATHESIS_HOOKS=schema_checks): positive
data acceptance, but for the refusals a JSON schema cannot express."""

from __future__ import annotations

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

from cellbatch.server.openapi import CROSS_FIELD_CODES


@schemathesis.check
def accepted_unless_cross_field(ctx, response, case):  # type: ignore[no-untyped-def]
    """`positive_data_acceptance`, except that a schema-valid request may be refused
    with a 400 whose code says its parts do not go together (`CROSS_FIELD_CODES`:
    prompt and max_tokens beyond the context, a tool_choice naming a function not
    among the tools, ...), which no JSON schema can say."""
    if response.status_code == 400:
        try:
            error = response.json().get("error")
        except ValueError:
            error = None
        if isinstance(error, dict) and error.get("code") in CROSS_FIELD_CODES:
            return None
    return positive_data_acceptance(ctx, response, case)
