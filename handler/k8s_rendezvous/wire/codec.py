"""Reading the wire format: the checks every decoder of it shares, and JSON read within
bounds.

Each type of the wire format is a frozen dataclass with an explicit camelCase codec:
``to_dict()`` gives the JSON the API server stores, ``from_dict()`` reads it back through
the readers here, which raise :class:`DecodeError` naming the offending field. Nothing is
pickled: anyone allowed to patch the status could otherwise make every pod run code of
their choosing.
"""

from __future__ import annotations

import datetime
import enum
import ipaddress
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final


class DecodeError(ValueError):
    """A stored object does not match the wire format; the message names the field."""


def decode_json(
    text: str | bytes,
    field: str,
    *,
    max_length: int,
    max_depth: int,
    max_values: int | None = None,
) -> object:
    """``text`` as JSON, read only within bounds: at most ``max_length`` characters (bytes,
    for bytes), arrays and objects nested at most ``max_depth`` deep, at most
    ``max_values`` values in all. Text a pod or any other client chose goes through here,
    so that nothing it writes makes a reader raise anything but :class:`DecodeError`, nor
    hold more than the bounds: thousands of ``[`` used to raise ``RecursionError`` out of
    ``json``, which no caller expected (one Lease stopped the operator's start).

    Raises:
        DecodeError: Not JSON, or beyond a bound; the message names ``field`` and the bound.
    """
    if len(text) > max_length:
        unit = "bytes" if isinstance(text, bytes) else "characters"
        raise DecodeError(f"{field}: {len(text)} {unit} long, more than {max_length}")
    try:
        value: object = json.loads(text)
    except RecursionError:  # nested far beyond max_depth: json gave up first
        raise DecodeError(f"{field}: nested more than {max_depth} deep") from None
    except ValueError as error:  # not JSON, not UTF-8, an integer of too many digits
        raise DecodeError(f"{field}: not JSON ({error})") from None
    pending: list[tuple[object, int]] = [(value, 1)]
    values = 0
    while pending:  # a loop, not a recursion: what is walked is the writer's choice
        item, depth = pending.pop()
        values += 1
        if max_values is not None and values > max_values:
            raise DecodeError(f"{field}: more than {max_values} values")
        if isinstance(item, dict):
            children: Iterable[object] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise DecodeError(f"{field}: nested more than {max_depth} deep")
        pending.extend((child, depth + 1) for child in children)
    return value


def format_time(moment: datetime.datetime) -> str:
    """RFC 3339 in UTC with microseconds, the form the API server accepts for date-time."""
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: object, field: str) -> datetime.datetime:
    """An RFC 3339 time with its time zone."""
    if not isinstance(text, str):
        raise DecodeError(f"{field}: expected an RFC 3339 time string, got {shown(text)}")
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as error:
        raise DecodeError(f"{field}: {shown(text)} is not an RFC 3339 time") from error
    if moment.tzinfo is None:
        raise DecodeError(f"{field}: {shown(text)} has no time zone")
    return moment


# The readers of one field: each raises DecodeError naming ``<field>.<key>``.


def mapping(value: object, field: str) -> Mapping[str, Any]:
    """``value`` if it is a JSON object."""
    if not isinstance(value, Mapping):
        raise DecodeError(f"{field}: expected an object, got {type(value).__name__}")
    return value


def string(
    data: Mapping[str, Any],
    key: str,
    field: str,
    *,
    default: str | None = None,
    max_length: int | None = None,
) -> str:
    """A string that is valid UTF-8, of 1 to ``max_length`` characters if that is given."""
    value = data.get(key, default)
    if not isinstance(value, str):
        raise DecodeError(f"{field}.{key}: expected a string, got {shown(value)}")
    try:
        value.encode()
    except UnicodeEncodeError:  # JSON's "\ud800": stored otherwise than it was read
        raise DecodeError(f"{field}.{key}: not valid UTF-8 (a lone surrogate)") from None
    if max_length is not None and not 0 < len(value) <= max_length:
        raise DecodeError(f"{field}.{key}: must be 1 to {max_length} characters, got {len(value)}")
    return value


def part(value: object) -> Mapping[str, Any]:
    """A part of an object that should be a JSON object, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def list_part(value: object) -> list[Any]:
    """A part of an object that should be a JSON array, else an empty one."""
    return value if isinstance(value, list) else []


_PRINTABLE: Final = re.compile(r"^[!-~]+\Z")


def printable(value: object, max_length: int) -> bool:
    """Whether ``value`` is 1 to ``max_length`` characters of printable ASCII."""
    return isinstance(value, str) and len(value) <= max_length and bool(_PRINTABLE.match(value))


def shown(value: object, limit: int = 80) -> str:
    """``value`` as a message may quote it: its repr, cut."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def canonical_ip(text: str, field: str) -> str:
    """``text`` if it is an IP address as the API server writes pod IPs, so that one
    address is stored, and compared with a pod's, in one form only."""
    try:
        canonical = str(ipaddress.ip_address(text))
    except ValueError:
        raise DecodeError(f"{field}: not an IP address: {shown(text)}") from None
    if canonical != text:
        raise DecodeError(f"{field}: {shown(text)} is not in canonical form; write {canonical!r}")
    return canonical


def integer(
    data: Mapping[str, Any],
    key: str,
    field: str,
    *,
    default: int | None = None,
    minimum: int = 0,
    maximum: int | None = None,
) -> int:
    """An integer (``True`` is not one) from ``minimum`` to ``maximum``."""
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeError(f"{field}.{key}: expected an integer, got {shown(value)}")
    if value < minimum:
        raise DecodeError(f"{field}.{key}: must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise DecodeError(f"{field}.{key}: must be at most {maximum}, got {value}")
    return value


def enumerated(enum_type: type[enum.Enum], data: Mapping[str, Any], key: str, field: str) -> Any:
    """One of ``enum_type``'s members, by its value."""
    value = data.get(key)
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in enum_type)
        raise DecodeError(f"{field}.{key}: {shown(value)} is not one of {allowed}") from None


def listed(data: Mapping[str, Any], key: str, field: str) -> list[Any]:
    """A list, empty when absent."""
    value = data.get(key) or []
    if not isinstance(value, list):
        raise DecodeError(f"{field}.{key}: expected a list")
    return value


class Fields:
    """One JSON object of a wire format, read key by key with the checks of this codec:
    each read raises :class:`DecodeError` naming ``<field>.<key>``. For the pod side's other
    records (:mod:`k8s_rendezvous.handoff`), so they decode as strictly as the status."""

    def __init__(self, value: object, field: str) -> None:
        self.data = mapping(value, field)
        self.field = field

    def integer(self, key: str) -> int:
        """A non-negative integer (``True`` is not one)."""
        return integer(self.data, key, self.field)

    def optional_integer(self, key: str) -> int | None:
        return None if self.data.get(key) is None else self.integer(key)

    def string(self, key: str) -> str:
        return string(self.data, key, self.field)

    def optional_string(self, key: str) -> str | None:
        return None if self.data.get(key) is None else self.string(key)

    def strings(self, key: str) -> tuple[str, ...]:
        """A list of strings, empty when absent."""
        values = listed(self.data, key, self.field)
        for index, value in enumerate(values):
            if type(value) is not str:
                raise DecodeError(
                    f"{self.field}.{key}[{index}]: expected a string, got {shown(value)}"
                )
        return tuple(values)
