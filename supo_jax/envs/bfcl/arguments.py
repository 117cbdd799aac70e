"""The check of one call's arguments against its BFCL doc, before anything runs.

Names: every required parameter given, no unknown one. Types as the doc declares them
(string, integer, float: an integer or a finite float, boolean, array and tuple: a JSON
array, dict: a JSON object, any), enums, and the declared types of array items and object
properties. Sizes capped: a value that passes the doc can still be made huge (`"x" * n` is
refused by the types; a string of 10^5 characters or an integer of 4,000 digits is not).
BFCL's executor checks none of this (it passes the values to the method as given); its
ground truth keeps the declared types but for one parameter (WIDENED).
"""
from __future__ import annotations

import json
import math

MAX_STRING = 10_000     # characters of one string (BFCL's ground truth: at most 6,690)
MAX_ITEMS = 1_000       # items of one array, keys of one object (ground truth: at most 6)
MAX_INT = 10 ** 18      # magnitude of one integer (ground truth: at most 987,654)
MAX_DEPTH = 32          # nesting of arrays and objects (as supo_jax.text.parsing's)
# where BFCL's own ground truth passes another type than its doc declares: close_ticket's
# ticket_id, an integer, is "ticket_001" in task 173 of every category
WIDENED = {("close_ticket", "ticket_id"): ("string",)}

_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "tuple": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
}
_NAMES = {str: "string", int: "integer", float: "float", bool: "boolean", list: "array",
          dict: "dict", type(None): "null"}


def _size_error(value, where: str) -> str | None:
    if isinstance(value, str) and len(value) > MAX_STRING:
        return f"{where} is too long ({len(value)} characters; at most {MAX_STRING})"
    if isinstance(value, (list, dict)) and len(value) > MAX_ITEMS:
        return f"{where} has too many items ({len(value)}; at most {MAX_ITEMS})"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"{where} is too large (at most {MAX_INT:.0e} in magnitude)"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where} is not a finite number"
    return None


def _check(value, doc: dict, where: str, also: tuple = (), depth: int = 1) -> str | None:
    """The first thing wrong with one value (its size, type, enum, items, properties)."""
    if (err := _size_error(value, where)) is not None:
        return err
    if depth > MAX_DEPTH and isinstance(value, (list, dict)):
        return f"{where} is nested deeper than {MAX_DEPTH} levels"
    declared = doc.get("type", "any")
    types = (declared, *also)
    if "any" not in types and not any(_TYPES.get(t, lambda v: True)(value) for t in types):
        got = _NAMES.get(type(value), type(value).__name__)
        return f"wrong type for {where}: expected {' or '.join(types)}, got {got}"
    if "enum" in doc and value not in doc["enum"]:
        return f"invalid value for {where}: expected one of {doc['enum']}"
    if isinstance(value, list):
        items = doc.get("items") if isinstance(doc.get("items"), dict) else {}
        for k, item in enumerate(value):
            if (err := _check(item, items, f"{where}[{k}]", depth=depth + 1)) is not None:
                return err
    if isinstance(value, dict):
        props = doc.get("properties") or {}
        for key, item in value.items():
            sub = props.get(key) if isinstance(props.get(key), dict) else {}
            err = _check(item, sub, f"{where}[{json.dumps(key)[:100]}]", depth=depth + 1)
            if err is not None:
                return err
    return None


def check_arguments(doc: dict, arguments: dict) -> str | None:
    """What is wrong with `arguments` for the function of BFCL doc `doc` (None: nothing)."""
    name = doc["name"]
    params = doc.get("parameters") or {}
    props = params.get("properties") or {}
    for key in params.get("required") or ():
        if key not in arguments:
            return f"missing required argument {json.dumps(key)} for {name}"
    for key, value in arguments.items():
        if key not in props:
            return (f"unexpected argument {json.dumps(key)[:100]} for {name} "
                    f"(expected: {', '.join(props) or 'none'})")
        err = _check(value, props[key], f"argument {json.dumps(key)} of {name}",
                     WIDENED.get((name, key), ()))
        if err is not None:
            return err
    return None


def read_as_declared(doc: dict, arguments: dict) -> dict:
    """Arguments written as text (the seed_oss call form gives every value as text): each
    value of a parameter declared other than string read as JSON where it parses."""
    props = (doc.get("parameters") or {}).get("properties") or {}
    out = {}
    for key, value in arguments.items():
        declared = (props.get(key) or {}).get("type", "string")
        if isinstance(value, str) and declared not in ("string", "any") and (
                len(value) <= MAX_STRING):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                pass
        out[key] = value
    return out
