"""A JSON request body decoded into its API's request Struct (OpenAI's, Anthropic's, the Responses API's, the
adapter routes'), read as laxly as OpenAI's own server reads it, with a 400 that names the bad field."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import msgspec
import msgspec.inspect

from conveyor.transport import RequestError


def decode_body(body: bytes, kind: type[msgspec.Struct],
                unknown: Callable[[list[str]], None] | None = None) -> Any:
    """Parse a JSON body into a request Struct.

    Args:
        unknown: called with the body's top-level fields that ``kind`` does not have (none: they are ignored
            unseen); it may raise a RequestError to refuse them.

    Raises:
        RequestError: 400 naming the bad field (or saying the JSON is malformed).
    """
    try:
        # lax as OpenAI's own server and pydantic-based ones are: 1.0 is an integer (JSON Schema says so too), "2"
        # a number; "hot" is still no temperature
        if b"null" in body or unknown is not None:
            # a field given as null is a field left out, as OpenAI's and vLLM's servers read it (OpenAI's SDK sends
            # None as null: `n=None` is n's default, not a type error), in the body and in its objects
            fields = msgspec.json.decode(body)
            if isinstance(fields, dict):
                if unknown is not None and (extra := [k for k in fields if k not in _field_names(kind)]):
                    unknown(extra)
                return msgspec.convert(_without_nulls(fields, _type_info(kind)), kind, strict=False)
        return msgspec.json.decode(body, type=kind, strict=False)
    except msgspec.ValidationError as e:
        message, _, path = str(e).partition(" - at ")
        param = path.strip("`").removeprefix("$.") or None
        if param is None and (missing := re.match(r"Object missing required field `(\w+)`", message)):
            param = missing.group(1)  # (the top level's path is "$", which names no field)
        raise RequestError(f"{param}: {message}" if param else message, 400, param) from None
    except msgspec.DecodeError as e:
        raise RequestError(f"the body is not valid JSON: {e}", 400) from None


@functools.cache
def _field_names(kind: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(field.encode_name for field in msgspec.structs.fields(kind))


@functools.cache
def _type_info(kind: type[msgspec.Struct]) -> msgspec.inspect.Type:
    return msgspec.inspect.type_info(kind)


def _without_nulls(value: Any, kind: msgspec.inspect.Type) -> Any:
    """A JSON value of type ``kind`` without the fields sent as null: in its objects that are Structs, at any depth
    (a dict's nulls, a JSON schema's or a message's, mean something and stay)."""
    if isinstance(kind, msgspec.inspect.UnionType):
        shape = msgspec.inspect.StructType if isinstance(value, dict) else msgspec.inspect.ListType
        return next((_without_nulls(value, t) for t in kind.types if isinstance(t, shape)), value)
    if isinstance(kind, msgspec.inspect.StructType) and isinstance(value, dict):
        types = {field.encode_name: field.type for field in kind.fields}
        return {k: _without_nulls(v, types[k]) if k in types else v for k, v in value.items() if v is not None}
    if isinstance(kind, msgspec.inspect.ListType) and isinstance(value, list):
        return [_without_nulls(item, kind.item_type) for item in value]
    return value
