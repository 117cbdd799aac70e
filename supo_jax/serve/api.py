"""The OpenAI wire format, as pure functions: request checking and response bodies.

Requests are plain JSON values from an untrusted client; `chat_request` and
`completion_request` check every field the server reads and raise ApiError (a 4xx with an
OpenAI-style error body naming the field in `param`) on anything else. Fields the server
does not read (penalties, logit_bias, user, ...) are ignored, as vLLM does.

Responses are built from token ids, log-probabilities and the policy's text. Tool calls are
read with the policy's own tool-call parser (supo_jax.text.parsing): text that holds no
valid call is plain content, never an error. `return_token_ids: true` (vLLM's dialect, which
the `verifiers` library reads) adds `prompt_token_ids` to the response and `token_ids` to
each choice (and to each streamed chunk): the exact ids the sampler saw and sampled.
`ignore_eos: true` (vLLM's too) samples on past the policy's stop tokens: a choice ends at
max_tokens, the context's end or a stop string (benchmarks and load tests ask for it).
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid

from supo_jax.text.parsing import parse_action

MAX_N = 16          # choices a request may ask for
MAX_STOP = 4        # stop strings (as OpenAI's API)
MAX_TOP_LOGPROBS = 20
ROLES = ("system", "developer", "user", "assistant", "tool")
# where a tool call starts in each call form (supo_jax.text.parsing.CALL_FORMATS)
CALL_MARKERS = {"hermes": "<tool_call>", "seed_oss": "<seed:tool_call>",
                "mistral": "[TOOL_CALLS]"}


class ApiError(Exception):
    """A request the server refuses: HTTP `status`, OpenAI error `kind` (its "type"), the
    `param` it names, and extra response `headers` (429's Retry-After)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = (
            message, param, status, kind, code)
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What a request asks of the sampler (`n` choices: one engine row each)."""
    max_tokens: int | None       # None: up to the context's end
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    ignore_eos: bool = False     # vLLM's: the stop tokens do not end a choice (max_tokens does)


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...]
    tool_choice: str | dict
    sampling: Sampling


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]
    sampling: Sampling
    echo: bool = False


def _number(body: dict, name: str, lo: float, hi: float, default, integer: bool = False,
            open_low: bool = False):
    """body[name] checked to be a number (an integer) in [lo, hi] ((lo, hi] if open_low);
    `default` where absent or null."""
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (
            integer and not isinstance(v, int)):
        raise ApiError(f"{name} must be {'an integer' if integer else 'a number'}, got "
                       f"{json.dumps(v)[:40]}", name)
    if not (lo < v if open_low else lo <= v) or not v <= hi:
        raise ApiError(f"{name} must be in {'(' if open_low else '['}{lo}, {hi}], got {v}", name)
    return v


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(f"{name} must be a boolean", name)
    return v


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
            and len(stop) <= MAX_STOP):
        raise ApiError(f"stop must be a non-empty string or a list of at most {MAX_STOP} "
                       "non-empty strings", "stop")
    return tuple(stop)


def _logprobs(body: dict, chat: bool) -> tuple[bool, int]:
    """(logprobs wanted, top tokens per position). Chat: logprobs a boolean, top_logprobs
    0-20; Completions: logprobs the number of top tokens (0-5)."""
    if not chat:
        lp = _number(body, "logprobs", 0, 5, None, integer=True)
        return lp is not None, lp or 0
    logprobs = _flag(body, "logprobs")
    top = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0, integer=True)
    if top and not logprobs:
        raise ApiError("top_logprobs needs logprobs: true", "top_logprobs")
    return logprobs, top


def _sampling(body: dict, max_tokens_names: tuple[str, ...], chat: bool) -> Sampling:
    mt = None
    for name in max_tokens_names:
        if body.get(name) is not None:
            mt = _number(body, name, 1, 1 << 30, None, integer=True)
    logprobs, top = _logprobs(body, chat)
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError("stream_options must be an object", "stream_options")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError("seed must be an integer", "seed")
    return Sampling(max_tokens=mt, temperature=float(_number(body, "temperature", 0, 2, 1.0)),
                    top_p=float(_number(body, "top_p", 0, 1, 1.0, open_low=True)),
                    n=_number(body, "n", 1, MAX_N, 1, integer=True), stop=_stop(body),
                    seed=None if seed is None else seed % (1 << 31), logprobs=logprobs,
                    top_logprobs=top, stream=_flag(body, "stream"),
                    include_usage=bool(opts.get("include_usage", False)),
                    return_token_ids=_flag(body, "return_token_ids"),
                    ignore_eos=_flag(body, "ignore_eos"))


def _text(content, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ApiError(f"{where}: only text content parts are supported", where)
            out.append(part["text"])
        return "".join(out)
    raise ApiError(f"{where} must be a string or a list of text parts", where)


def _arguments(args, where: str) -> dict:
    """A call's arguments (a JSON object, or its JSON text, as the API sends it) as a dict."""
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            raise ApiError(f"{where} is not JSON", where) from None
    if not isinstance(args, dict):
        raise ApiError(f"{where} must be a JSON object", where)
    return args


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls, checked; arguments as objects (what chat templates
    render with `tojson`)."""
    if not isinstance(calls, list):
        raise ApiError(f"{where} must be a list", where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise ApiError(f"{where}[{j}].function.name must be a string",
                           f"{where}[{j}].function.name")
        out.append({"id": str(c.get("id") or f"call_{j}"), "type": "function",
                    "function": {"name": fn["name"], "arguments": _arguments(
                        fn.get("arguments", "{}"), f"{where}[{j}].function.arguments")}})
    return out


def messages_of(raw) -> tuple[dict, ...]:
    """Chat messages checked and normalized: {role, content (text)[, tool_calls]
    [, tool_call_id]}; "developer" is read as "system"."""
    if not isinstance(raw, list) or not raw:
        raise ApiError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} must be an object", where)
        if m.get("role") not in ROLES:
            raise ApiError(f"{where}.role must be one of {', '.join(ROLES)}, got "
                           f"{json.dumps(m.get('role'))[:40]}", f"{where}.role")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        out.append(msg)
    return tuple(out)


def _schema(params, where: str) -> dict:
    """A function's parameters: a JSON-schema object ({"type": "object", ...}); absent or
    null is a function without arguments."""
    if params is None:
        return {"type": "object", "properties": {}}
    if not (isinstance(params, dict) and params.get("type", "object") == "object"
            and isinstance(params.get("properties", {}), dict)):
        raise ApiError(f"{where} must be a JSON schema of type object", where)
    return params


def tools_of(raw) -> tuple[dict, ...]:
    """OpenAI function tools, checked: [{type: function, function: {name, description,
    parameters}}]; anything else (another tool type, no name, parameters that are not an
    object schema) is an error naming the tool."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ApiError("tools must be a list", "tools")
    out = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise ApiError(f"tools[{i}] must be {{type: function, function: {{name, ...}}}}",
                           f"tools[{i}]")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ApiError(f"tools[{i}].function.description must be a string",
                           f"tools[{i}].function.description")
        out.append({"type": "function", "function": {
            "name": fn["name"], "description": desc or "",
            "parameters": _schema(fn.get("parameters"), f"tools[{i}].function.parameters")}})
    return tuple(out)


def tool_choice_of(raw, tools: tuple[dict, ...]) -> str | dict:
    """tool_choice checked: "none", "auto" (the default with tools), "required" (tools needed),
    or {type: function, function: {name}} naming one of `tools`."""
    if raw is None:
        return "auto" if tools else "none"
    names = {t["function"]["name"] for t in tools}
    if raw in ("none", "auto") or (raw == "required" and tools):
        return raw
    if (isinstance(raw, dict) and isinstance(raw.get("function"), dict)
            and raw["function"].get("name") in names):
        return raw
    raise ApiError("tool_choice must be 'none', 'auto', 'required' (with tools) or "
                   "{type: function, function: {name}} naming one of `tools`", "tool_choice")


def _model(body: dict, models: tuple[str, ...]) -> str:
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError("model must be a string", "model")
    if model not in models:
        raise ApiError(f"the model {model!r} does not exist; this server serves "
                       f"{', '.join(map(repr, models))}", "model", 404, code="model_not_found")
    return model


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def chat_request(body, models: tuple[str, ...]) -> ChatRequest:
    """A /v1/chat/completions body, checked."""
    body = _object(body)
    model = _model(body, models)
    messages = messages_of(body.get("messages"))
    tools = tools_of(body.get("tools"))
    return ChatRequest(model, messages, tools, tool_choice_of(body.get("tool_choice"), tools),
                       _sampling(body, ("max_tokens", "max_completion_tokens"), chat=True))


def completion_request(body, models: tuple[str, ...]) -> CompletionRequest:
    """A /v1/completions body, checked (one prompt: a string or a list of token ids)."""
    body = _object(body)
    model = _model(body, models)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise ApiError("prompt must be a non-empty string or a list of token ids (one prompt "
                       "a request)", "prompt")
    s = _sampling(body, ("max_tokens",), chat=False)
    if s.max_tokens is None:   # the Completions API's default
        s = dataclasses.replace(s, max_tokens=16)
    return CompletionRequest(model, prompt, s, _flag(body, "echo"))


# text as it streams


def stop_hold(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could begin a stop string (not shown yet:
    the next token may complete it)."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                if text.endswith(s[:k])), default=0)


def call_start(text: str, formats) -> int:
    """Where a tool call may begin in streamed `text` (len(text) when it cannot yet): at a
    call marker of `formats`, at a trailing partial marker, at trailing whitespace before
    one, and (llama3_json: an action that is one JSON object) at 0 while the text is blank
    or starts with "{"."""
    if "llama3_json" in formats and text.lstrip()[:1] in ("", "{", "<"):
        return 0
    markers = [m for f, m in CALL_MARKERS.items() if f in formats]
    at = min((i for i in (text.find(m) for m in markers) if i >= 0), default=len(text))
    at = min(at, len(text) - stop_hold(text, tuple(markers)))
    return len(text[:at].rstrip())


def split_tool_calls(text: str, tools: tuple[dict, ...], formats) -> tuple[str, list[dict]]:
    """(content, tool_calls) of a reply: the calls in the policy's tool-call forms, each
    checked against its tool's schema; content is the text before the first call (trailing
    whitespace dropped). A reply whose calls do not parse is all content."""
    if not tools:
        return text, []
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    parsed = parse_action(text, schemas, answer_tool="", max_calls=64, formats=formats)
    if parsed.kind == "error":
        return text, []
    content = text[:call_start(text, formats)]
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": name, "arguments": json.dumps(args)}}
             for name, args in parsed.calls]
    return content, calls


# response bodies


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_choice(index: int, content: str, tool_calls: list[dict], finish: str,
                logprobs: list[dict] | None, token_ids: list[int] | None) -> dict:
    """One choice of a chat.completion; finish_reason "tool_calls" where the reply made
    calls; `token_ids` only where asked (return_token_ids)."""
    msg = {"role": "assistant", "content": content if (content or not tool_calls) else None}
    if tool_calls:
        msg["tool_calls"] = tool_calls
        finish = "tool_calls"
    out = {"index": index, "message": msg, "finish_reason": finish,
           "logprobs": None if logprobs is None else {"content": logprobs}}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict,
               finish: str | None = None, logprobs: list[dict] | None = None,
               token_ids: list[int] | None = None) -> dict:
    choice = {"index": index, "delta": delta, "finish_reason": finish,
              "logprobs": None if logprobs is None else {"content": logprobs}}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice]}


def token_logprob_entries(pieces: list[str], logprobs: list[float],
                          tops: list[list[tuple[str, float]]] | None) -> list[dict]:
    """The chat API's logprobs.content: one entry a sampled token."""
    return [{"token": p, "logprob": lp, "bytes": list(p.encode("utf-8")),
             "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
                              for t, v in (tops[i] if tops else [])]}
            for i, (p, lp) in enumerate(zip(pieces, logprobs))]


def completion_logprobs(pieces: list[str], logprobs: list[float],
                        tops: list[list[tuple[str, float]]] | None, start: int = 0) -> dict:
    """The Completions API's logprobs object; text offsets counted from `start`."""
    offsets, at = [], start
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {"tokens": pieces, "token_logprobs": logprobs,
            "top_logprobs": [dict(t) for t in tops] if tops else None, "text_offset": offsets}


def now() -> int:
    return int(time.time())
