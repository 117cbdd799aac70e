"""Tool-call parsing of one model action (untrusted text), Qwen/Hermes style.

An action is free text holding tool calls of the form

    <tool_call>
    {"name": "compare", "arguments": {"i": 3, "j": 7}}
    </tool_call>

(whitespace around the JSON is allowed). Where the policy's chat template writes its
calls in another form, `formats` (CALL_FORMATS) adds it: "seed_oss"
`<seed:tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></seed:tool_call>`
(values typed by the tool's schema; such a body in <tool_call> too, as Qwen3-Coder writes
it), and, without a tag, "mistral" `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]` and
"llama3_json", an action that is one JSON object `{"name": ..., "parameters": {...}}`.
The call whose name is the answer tool
("finish" by default) ends the episode. `parse_action` never raises and never
slows down on hostile input: every failure is a ParsedAction(kind="error") whose
message tells the model what to fix, quoting at most QUOTE_CHARS of its text.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass

from supo_jax.text.templates import FOLD_TOOLS

MAX_ACTION_CHARS = 20_000   # longer actions are rejected before any parsing
MAX_JSON_DEPTH = 32         # deeper nesting of arrays/objects is rejected
QUOTE_CHARS = 100           # most model text an error message repeats
_TAG = re.compile(r"<(/?)tool_call>")
_SEED_TAG = re.compile(r"<(/?)(?:seed:)?tool_call>")
_MISTRAL_TAG, _PYTHON_TAG = "[TOOL_CALLS]", "<|python_tag|>"
# the call forms parse_action reads: "hermes" always; the others where the policy's chat
# template writes its calls so (supo_jax.agent.render.ChatFormat.call_formats)
CALL_FORMATS = ("hermes", "seed_oss", "llama3_json", "mistral")
_SUMMARY_CLOSE, _SUMMARY_OPEN = "</summary>", "<summary>"
_HINT = 'write it as <tool_call>{"name": ..., "arguments": {...}}</tool_call>'


@dataclass(frozen=True)
class ParsedAction:
    """kind: "call" (a tool call), "answer" (the answer tool was called) or "error".

    name/arguments: the (last) call; calls: every call in order as (name, arguments)
    pairs (more than one only when max_calls > 1); error: message for the model.
    """
    kind: str
    name: str | None = None
    arguments: dict | None = None
    error: str | None = None
    calls: tuple = ()


def quote(text, limit: int = QUOTE_CHARS) -> str:
    """Short, printable, UTF-8-safe quotation of untrusted text for an error message."""
    s = text if isinstance(text, str) else repr(text)
    s = json.dumps(s[:limit] + ("..." if len(s) > limit else ""), ensure_ascii=False)
    # lone surrogates (from "\ud800" escapes or bad decoding) would break the tokenizer
    return s.encode("utf-8", "replace").decode("utf-8")


def _error(msg: str) -> ParsedAction:
    return ParsedAction(kind="error", error=msg)


def _too_deep(obj, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether parsed JSON nests containers deeper than limit (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if isinstance(o, (dict, list)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (o.values() if isinstance(o, dict) else o))
    return False


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?')  # a string, or an unterminated one to the end
_NESTING = {"[": 1, "{": 1, "]": -1, "}": -1}


def _deepest(text: str) -> int:
    """The deepest bracket nesting of (possibly broken) JSON text, outside its strings."""
    steps = [_NESTING[c] for c in _JSON_STRING.sub("", text) if c in _NESTING]
    return max(itertools.accumulate(steps), default=0)


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


_TYPE_OK = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool)
                         and math.isfinite(v)),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}
_JSON_NAME = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
              dict: "object", type(None): "null"}


def _check_value(value, schema: dict, where: str) -> str | None:
    """Check a JSON value against a small JSON-schema subset (type, enum, items, properties)."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        if not any(_TYPE_OK.get(t, lambda v: True)(value) for t in types):
            return (f"wrong type for {where}: expected {' or '.join(types)}, "
                    f"got {_JSON_NAME.get(type(value), 'value')}")
    if "enum" in schema and value not in schema["enum"]:
        return f"invalid value {quote(value)} for {where}: expected one of {schema['enum']}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for k, item in enumerate(value):
            if (err := _check_value(item, schema["items"], f"{where}[{k}]")) is not None:
                return err
    if isinstance(value, dict) and "properties" in schema:
        return _check_object(value, schema, where)
    return None


def _check_object(obj: dict, schema: dict, where: str) -> str | None:
    props = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in obj:
            return f"missing required argument {quote(key)} for {where}"
    if not schema.get("additionalProperties", False):
        for key in obj:
            if key not in props:
                return (f"unexpected argument {quote(key)} for {where} "
                        f"(expected: {', '.join(props) or 'none'})")
    for key, value in obj.items():
        if key in props and (err := _check_value(value, props[key], f"argument {quote(key)}")):
            return err
    return None


def _load_json(body: str):
    """(parsed JSON, None) or (None, error message); never slow, never raises."""
    too_deep = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
    try:  # the C decoder is linear-time; it raises RecursionError on extreme nesting
        obj = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:  # where it is raised depends on the caller's stack depth, so
        return None, too_deep  # an error further on counts as too deep when the text nests
    except ValueError as e:  # deeper than the limit before it: the same verdict everywhere
        if isinstance(e, json.JSONDecodeError):
            if _deepest(body[:e.pos]) > MAX_JSON_DEPTH:
                return None, too_deep
            return None, f"malformed JSON in tool call ({e.msg} near {quote(body[e.pos:e.pos + 30])})"
        return None, f"malformed JSON in tool call ({str(e)[:80]})"
    if body.count("[") + body.count("{") > MAX_JSON_DEPTH and _too_deep(obj):
        return None, too_deep
    return obj, None


def _typed(raw: str, schema: dict):
    """A <parameter=...> value as the schema types it: text for a string, else its JSON value
    (text again when that fails, so that the schema check names the wrong type)."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if not types or "string" in types:
        return raw
    obj, err = _load_json(raw.strip())
    return raw if err else obj


def _function_call(body: str, tools: dict[str, dict]):
    """'<function=NAME><parameter=KEY>VALUE</parameter>...</function>' (Seed-OSS, Qwen3-Coder)
    -> (call object, None) or (None, error message). Scanned with str.find: linear time."""
    s = body.strip()
    head_end, close = s.find(">"), s.rfind("</function>")
    if head_end < 0 or close < head_end:
        return None, "unterminated <function=...>: end the call with </function>"
    name = s[len("<function="):head_end].strip()
    props = (tools.get(name) or {}).get("properties", {})
    args, pos, rest = {}, 0, s[head_end + 1:close]
    while (i := rest.find("<parameter=", pos)) >= 0:
        j = rest.find(">", i)
        k = rest.find("</parameter>", j) if j >= 0 else -1
        if k < 0:
            return None, "unterminated <parameter=...>: end each value with </parameter>"
        key = rest[i + len("<parameter="):j].strip()
        args[key] = _typed(rest[j + 1:k].strip("\n"), props.get(key) or {})
        pos = k + len("</parameter>")
    return {"name": name, "arguments": args}, None


def _load_call(body: str, tools: dict[str, dict], formats):
    """A tag's body: a JSON call object, or (seed_oss) a <function=...> call."""
    if "seed_oss" in formats and body.lstrip().startswith("<function="):
        return _function_call(body, tools)
    return _load_json(body)


def _check_call(obj, tools: dict[str, dict], formats=("hermes",)) -> tuple[str, dict] | str:
    """One parsed call object -> (name, arguments), or an error message. The arguments are
    "arguments" (Hermes, Mistral), or under llama3_json "parameters" where that is absent."""
    if not isinstance(obj, dict):
        return f"the tool call must be a JSON object, got {_JSON_NAME.get(type(obj), 'value')}"
    if "name" not in obj:
        return 'the tool call has no "name"'
    name = obj["name"]
    if not isinstance(name, str):
        return '"name" must be a string'
    if name not in tools:
        return f"unknown tool {quote(name)}; valid tools: {', '.join(sorted(tools))}"
    key = "parameters" if "llama3_json" in formats and "arguments" not in obj else "arguments"
    args = obj.get(key, {})
    if not isinstance(args, dict):
        got = _JSON_NAME.get(type(args), "value")
        return f'"arguments" of {name} must be a JSON object, got {got}'
    err = _check_object(args, tools[name] or {}, name)
    return err if err is not None else (name, args)


def _native_calls(text: str, formats) -> list | str | None:
    """Calls without a tag, in the forms `formats` allow: Mistral's '[TOOL_CALLS] [{"name":
    ..., "arguments": {...}}, ...]' and Llama 3.x's action that is one JSON object
    '{"name": ..., "parameters": {...}}' (after an optional <|python_tag|>). A list of call
    objects, an error message, or None (no such call)."""
    s = text.strip()
    at = s.find(_MISTRAL_TAG) if "mistral" in formats else -1
    if at >= 0:
        obj, err = _load_json(s[at + len(_MISTRAL_TAG):].strip())
        return err or (obj if isinstance(obj, list) else [obj])
    if "llama3_json" not in formats:
        return None
    if s.startswith(_PYTHON_TAG):
        s = s[len(_PYTHON_TAG):].strip()
    if s.startswith("{") and s.endswith("}"):
        obj, err = _load_json(s)
        if err is None and isinstance(obj, dict) and "name" in obj:
            return [obj]
    return None


def parse_action(text: str, tools: dict[str, dict], answer_tool: str = "finish",
                 max_calls: int = 1, max_chars: int = MAX_ACTION_CHARS,
                 formats=("hermes",)) -> ParsedAction:
    """Parse one model action.

    tools: tool name -> JSON-schema "parameters" object ({"type": "object", "properties":
    ..., "required": [...]}); extra arguments are rejected unless additionalProperties.
    formats: the call forms read besides Hermes tags (module docstring).
    Returns kind="answer" when the last call is `answer_tool` (which must be in `tools`),
    kind="call" otherwise, or kind="error" with a message for the model.
    """
    if not isinstance(text, str):
        return _error("the action is not text")
    if len(text) > max_chars:
        return _error(f"the action is too long ({len(text)} characters; limit {max_chars})")
    bodies, start = [], None
    for m in (_SEED_TAG if "seed_oss" in formats else _TAG).finditer(text):
        if not m.group(1):
            if start is not None:
                return _error("nested <tool_call> tag: close each call with </tool_call> "
                              "before opening another")
            start = m.end()
        else:
            if start is None:
                return _error("</tool_call> without an opening <tool_call>")
            bodies.append(text[start:m.start()])
            start = None
    if start is not None:
        return _error("unterminated <tool_call>: the call must end with </tool_call>")
    found = bodies or _native_calls(text, formats)
    if isinstance(found, str):
        return _error(found)
    if not found:
        return _error(f"no tool call found; {_HINT}")
    if len(found) > max_calls:
        return _error(f"too many tool calls ({len(found)}); make at most {max_calls} per turn")
    calls = []
    for call in found:
        obj, err = _load_call(call, tools, formats) if bodies else (call, None)
        parsed = err or _check_call(obj, tools, formats)
        if isinstance(parsed, str):
            return _error(parsed)
        calls.append(parsed)
    names = [n for n, _ in calls]
    if answer_tool in names[:-1]:
        return _error(f"{answer_tool} must be the last call of the turn")
    kind = "answer" if names[-1] == answer_tool else "call"
    return ParsedAction(kind=kind, name=calls[-1][0], arguments=calls[-1][1], calls=tuple(calls))


def extract_summary(text: str) -> str | None:
    """Content of the last complete <summary>...</summary> in text, stripped; None if none."""
    return extract_tagged(text, _SUMMARY_OPEN, _SUMMARY_CLOSE)


def extract_state(text: str) -> str | None:
    """Content of the last complete <state>...</state> in text (the state manager's block),
    stripped; None if none."""
    return extract_tagged(text, "<state>", "</state>")


def extract_tagged(text: str, open_tag: str, close_tag: str) -> str | None:
    if not isinstance(text, str):
        return None
    end = text.rfind(close_tag)
    if end < 0:
        return None
    start = text.rfind(open_tag, 0, end)
    return None if start < 0 else text[start + len(open_tag):end].strip()


def format_tool_call(name: str, arguments: dict) -> str:
    """Canonical call text: '<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>'.

    As in Hermes/Qwen, an argument value containing "</tool_call>" would not round-trip.
    """
    payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{payload}\n</tool_call>"


_FOLD_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in FOLD_TOOLS}


def fold_call(text: str) -> tuple[str, str] | None:
    """(branch | return, its description | message) where an action calls one of the fold
    manager's tools, ("error", why) where it calls one wrongly, else None (an action for
    the environment)."""
    loose = {name: {"type": "object", "additionalProperties": True} for name in _FOLD_PARAMS}
    if parse_action(text, loose, answer_tool="return").kind == "error":
        return None
    p = parse_action(text, _FOLD_PARAMS, answer_tool="return")
    if p.kind == "error":
        return "error", f"error: {p.error}"
    return p.name, str(next(iter(p.arguments.values())))
