"""Bus events as JSON text, for a bus that leaves the process (Redis Streams).

The wire form is an envelope `{"v": 1, "type": "inbound" | "outbound", "event": {...}}`
(and "approval" for the request an approval row keeps, store/approvals.py)
whose event holds every field of the dataclass by name: nested dataclasses
(ReplyRoute, ToolCall, ApprovalRequest with its ToolAction and Explanation,
TurnUsage, Sampling, the Messages of a history) as objects, tuples as arrays,
enums by value, the metadata mapping as an object, None as null. Decoding is
the exact inverse (`decode(encode(e)) == e`, with the same types: enums are
enums again, tuples tuples, metadata a read-only mapping) and strict: a
payload that is not this shape raises `ValueError` naming the field at fault.
A field missing from the payload takes its default, so a producer one version
behind still decodes; a field the dataclass does not have is rejected.

Error messages name fields and types, never values: the values are user content.
Text is written as ASCII JSON, so any Python string (a lone surrogate included)
survives the trip.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from ember.core.events import InboundEvent, OutboundEvent
from ember.core.tools import ApprovalRequest

VERSION = 1
_KINDS: dict[str, type[Any]] = {"inbound": InboundEvent, "outbound": OutboundEvent, "approval": ApprovalRequest}

E = TypeVar("E", InboundEvent, OutboundEvent, ApprovalRequest)


def encode_inbound(event: InboundEvent) -> str:
    return _encode_envelope("inbound", event)


def encode_outbound(event: OutboundEvent) -> str:
    return _encode_envelope("outbound", event)


def decode_inbound(payload: str | bytes) -> InboundEvent:
    return _decode_envelope(payload, "inbound", InboundEvent)


def decode_outbound(payload: str | bytes) -> OutboundEvent:
    return _decode_envelope(payload, "outbound", OutboundEvent)


def encode_approval(request: ApprovalRequest) -> str:
    """An approval request as its row keeps it, for a process other than the asker's to list."""
    return _encode_envelope("approval", request)


def decode_approval(payload: str | bytes) -> ApprovalRequest:
    return _decode_envelope(payload, "approval", ApprovalRequest)


def _encode_envelope(kind: str, event: Any) -> str:
    return json.dumps({"v": VERSION, "type": kind, "event": _to_json(event)}, separators=(",", ":"))


def _decode_envelope(payload: str | bytes, kind: str, cls: type[E]) -> E:
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"bus payload is not JSON text: {type(exc).__name__}") from None
    if not isinstance(data, dict):
        raise ValueError("bus payload is not an object")
    if type(data.get("v")) is not int or data["v"] != VERSION:
        raise ValueError(f"bus payload has an unknown version (this process reads v{VERSION})")
    if data.get("type") != kind:
        known = ", ".join(_KINDS)
        raise ValueError(f"bus payload is not an {kind} event (type must be one of {known})")
    if set(data) != {"v", "type", "event"}:
        raise ValueError("bus payload has keys other than v, type and event")
    return _from_json(cls, data["event"], kind)


def _to_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_to_json(item) for item in value]
    return value


@functools.cache
def _hints(cls: type[Any]) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _from_json(hint: Any, raw: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if raw is None and len(options) < len(typing.get_args(hint)):
            return None
        if len(options) != 1:
            raise TypeError(f"the codec does not support the union {hint!r} ({where})")
        return _from_json(options[0], raw, where)
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return _mapping(hint, raw, where)
    if origin is tuple:
        return _tuple(hint, raw, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum(hint, raw, where)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass(hint, raw, where)
    if hint in (str, bool, int, float):
        return _scalar(hint, raw, where)
    raise TypeError(f"the codec does not support the type {hint!r} ({where})")


def _scalar(hint: type[Any], raw: Any, where: str) -> Any:
    if hint is float and isinstance(raw, int | float) and not isinstance(raw, bool):
        return float(raw)
    if hint is int and isinstance(raw, bool):
        raise ValueError(f"{where} must be an integer, not a boolean")
    if not isinstance(raw, hint):
        raise ValueError(f"{where} must be {hint.__name__}, not {_json_type(raw)}")
    return raw


def _enum(hint: type[enum.Enum], raw: Any, where: str) -> enum.Enum:
    try:
        return hint(raw)
    except ValueError:
        raise ValueError(f"{where} is not a known {hint.__name__}") from None


def _mapping(hint: Any, raw: Any, where: str) -> Mapping[Any, Any]:
    key_type, value_type = typing.get_args(hint) or (str, str)
    if key_type is not str:
        raise TypeError(f"the codec supports string keys only ({where})")
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object, not {_json_type(raw)}")
    return types.MappingProxyType({k: _from_json(value_type, v, f"{where}[{k!r}]") for k, v in raw.items()})


def _tuple(hint: Any, raw: Any, where: str) -> tuple[Any, ...]:
    item_type, *rest = typing.get_args(hint)
    if rest != [Ellipsis]:
        raise TypeError(f"the codec supports tuples of one item type only ({where})")
    if not isinstance(raw, list):
        raise ValueError(f"{where} must be an array, not {_json_type(raw)}")
    return tuple(_from_json(item_type, item, f"{where}[{i}]") for i, item in enumerate(raw))


def _dataclass(cls: type[Any], raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object, not {_json_type(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"{where} has unknown fields: {', '.join(unknown)}")
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name in raw:
            values[name] = _from_json(hints[name], raw[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{where} lacks the required field {name}")
    return cls(**values)


def _json_type(raw: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(raw), type(raw).__name__)
