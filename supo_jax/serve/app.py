"""`supo-jax serve`: an OpenAI-compatible HTTP server over a policy (Starlette on uvicorn).

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions; with
harness sessions (supo_jax.serve.sessions, docs/HARNESS.md) also
POST /sessions/{sid}/v1/chat/completions and GET /sessions/{sid}/v1/models, and for
out-of-process harnesses GET /sessions/next and POST /sessions/{sid}/reward.
Every request is checked (supo_jax.serve.api); a bad one is a 4xx with an OpenAI-style
error body naming the field. A request's n choices are n rows of one Engine (continuous
batching); a client that goes away, streaming or not, frees its rows.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time

import numpy as np

from supo_jax.agent.render import ChatFormat
from supo_jax.sampling.sampler import SamplingParams, bucket
from supo_jax.serve import api
from supo_jax.serve.api import ApiError
from supo_jax.serve.engine import Engine, Event, Job, QueueFull
from supo_jax.serve.sessions import (Sessions, session_chat, session_models, session_next,
                                     session_reward)
from supo_jax.text.parsing import format_tool_call

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20     # a larger request body is refused (413)
RETRY_AFTER_S = 1            # what a 429 tells the client to wait
DISCONNECT_POLL_S = 0.25     # how often a non-streamed request checks its client is there


class Server:
    """What the routes share: the engine, the policy's chat format, the served model name,
    the API key ("" for none)."""

    def __init__(self, engine: Engine, fmt: ChatFormat, model: str, api_key: str = ""):
        self.engine, self.fmt, self.model, self.api_key = engine, fmt, model, api_key
        self.counter = 0
        self.lock = threading.Lock()
        self.calls_in_template = renders_tool_calls(fmt)
        policy = getattr(engine, "policy", None)   # None: a scripted engine (serve/scripted.py)
        self.vocab_size = policy.config.vocab_size if policy is not None else len(fmt.tokenizer)

    def next_stream(self) -> int:
        """A fresh random stream for a request without a seed (disjoint from seeds' range)."""
        with self.lock:
            self.counter += 1
            return (1 << 30) + self.counter % (1 << 30)


# request bodies


async def read_json(request):
    """The request's JSON body: 413 past MAX_BODY_BYTES, 400 on invalid UTF-8 or JSON."""
    size = request.headers.get("content-length") or "0"
    if not size.isdigit() or int(size) > MAX_BODY_BYTES:
        raise ApiError(f"the request body is {size} bytes; the limit is {MAX_BODY_BYTES}",
                       status=413, code="request_too_large")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > MAX_BODY_BYTES:
            raise ApiError(f"the request body is over the limit of {MAX_BODY_BYTES} bytes",
                           status=413, code="request_too_large")
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None


def check_key(server: Server, request) -> None:
    sent = request.headers.get("authorization", "").encode()
    if server.api_key and not hmac.compare_digest(sent, f"Bearer {server.api_key}".encode()):
        raise ApiError("invalid or missing API key (Authorization: Bearer ...)", status=401,
                       kind="authentication_error", code="invalid_api_key")


# prompts


def renders_tool_calls(fmt: ChatFormat) -> bool:
    """Whether the chat template writes an assistant message's tool_calls (the tiny
    policies' templates, for one, render the content alone)."""
    call = {"role": "assistant", "content": "", "tool_calls": [{
        "id": "abcdefghi", "type": "function",
        "function": {"name": "supo_probe_tool", "arguments": {"x": 1}}}]}
    try:
        text = fmt.tokenizer.apply_chat_template(
            [{"role": "user", "content": "U"}, call], tools=ChatFormat._PROBE, tokenize=False)
    except Exception:   # noqa: BLE001 - a template that refuses tool calls renders none
        return False
    return "supo_probe_tool" in text.split("U", 1)[-1]


def template_messages(messages, calls_in_template: bool) -> list[dict]:
    """Messages for the chat template: where it does not write tool_calls itself, an
    assistant's calls are appended to its content in the Hermes form the policy reads."""
    if calls_in_template:
        return [dict(m) for m in messages]
    out = []
    for m in messages:
        calls = [format_tool_call(c["function"]["name"], c["function"]["arguments"])
                 for c in m.get("tool_calls", ())]
        text = "\n".join(([m["content"]] if m["content"] else []) + calls)
        out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
    return out


def chat_tokens(server: Server, req: api.ChatRequest) -> list[int]:
    """The conversation as the policy's chat template renders it, with the generation prompt."""
    msgs = template_messages(req.messages, server.calls_in_template)
    try:
        text = server.fmt.tokenizer.apply_chat_template(
            msgs, tools=list(req.tools) or None, tokenize=False, add_generation_prompt=True)
    except Exception as e:   # noqa: BLE001 - jinja's errors: a conversation the template refuses
        raise ApiError(f"the chat template cannot render these messages: {e}"[:300],
                       "messages") from None
    return server.fmt.encode(text)


def completion_tokens(fmt: ChatFormat, req: api.CompletionRequest, vocab: int) -> list[int]:
    if isinstance(req.prompt, tuple):
        if not all(0 <= t < vocab for t in req.prompt):
            raise ApiError(f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(req.prompt)
    return fmt.encode(req.prompt)


def budget(max_len: int, prompt: list[int], s: api.Sampling, param: str) -> int:
    """The request's new-token budget (max_tokens, or up to the context's end); an ApiError
    naming the context's size and the prompt's when they leave no room."""
    room = max_len - len(prompt)
    if room < 1:
        raise ApiError(f"the prompt is {len(prompt)} tokens; this server's context holds "
                       f"{max_len} tokens (prompt + completion)", param,
                       code="context_length_exceeded")
    if s.max_tokens is not None and s.max_tokens > room:
        raise ApiError(f"max_tokens = {s.max_tokens} and a prompt of {len(prompt)} tokens "
                       f"exceed this server's context of {max_len} tokens", "max_tokens",
                       code="context_length_exceeded")
    return s.max_tokens or room


# generation


def choice_text(fmt: ChatFormat, tokens: list[int], ignore_eos: bool = False) -> str:
    """A choice's tokens as text: less a trailing stop token; with ignore_eos, less every
    stop token (sampled on past, as vLLM's detokenizer leaves such special tokens out)."""
    if ignore_eos:
        return fmt.decode([t for t in tokens if t not in fmt.stop_ids])
    return fmt.action_text(tokens)


def stop_cut(fmt: ChatFormat, tokens: list[int], start: int, stops,
             ignore_eos: bool = False) -> int | None:
    """The fewest tokens (at least `start`) whose text holds a stop string; None if none
    does. The ids reported end there, whatever the decode calls that sampled them."""
    if not stops or not any(s in choice_text(fmt, tokens, ignore_eos) for s in stops):
        return None
    return next(k for k in range(max(start, 1), len(tokens) + 1)
                if any(s in choice_text(fmt, tokens[:k], ignore_eos) for s in stops))


class Choice:
    """One choice's generation, fed by the engine's events, read by the request's coroutine."""

    def __init__(self, fmt: ChatFormat, stop: tuple[str, ...], ignore_eos: bool = False):
        self.fmt, self.stop, self.ignore_eos = fmt, stop, ignore_eos
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None
        self.job: Job | None = None
        self.shown = 0            # characters of content streamed so far

    def take(self, ev: Event) -> tuple[int, int] | None:
        """Apply an event: the range of self.tokens it added; None once the choice has
        ended (a stop string ended it: the engine had sampled on). A stop string ends the
        choice at the token that completes it."""
        if self.finish:
            return None
        start = len(self.tokens)
        self.tokens += ev.tokens
        self.logprobs += ev.logprobs
        cut = stop_cut(self.fmt, self.tokens, start, self.stop, self.ignore_eos)
        if cut is not None:
            del self.tokens[cut:], self.logprobs[cut:]
            self.finish = "stop"
            self.job.cancel()
        elif ev.finish:
            self.finish = ev.finish
        return start, len(self.tokens)

    def text(self) -> str:
        """The choice's text: its tokens less a trailing stop token, cut before a stop string."""
        text = choice_text(self.fmt, self.tokens, self.ignore_eos)
        at = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return text[:min(at)] if at else text

    def reason(self) -> str:
        if self.finish and self.finish.startswith("error"):
            raise ApiError(f"generation failed: {self.finish}", status=500, kind="server_error")
        return self.finish or "stop"


class Generation:
    """A request's n choices: their engine jobs and the one queue their events arrive on."""

    def __init__(self, server: Server, prompt: list[int], s: api.Sampling, param: str):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt = prompt
        n_max = server.engine.rows + server.engine.queue_limit
        if s.n > n_max:
            raise ApiError(f"n = {s.n}: this server runs at most {n_max} choices at once", "n")
        max_new = budget(server.engine.max_len, prompt, s, param)
        sp = SamplingParams(temperature=s.temperature, top_p=s.top_p)
        base = s.seed if s.seed is not None else server.next_stream()
        self.choices = [Choice(server.fmt, s.stop, s.ignore_eos) for _ in range(s.n)]

        def feed(i):
            return lambda ev: loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev))
        stop_ids = frozenset() if s.ignore_eos else frozenset(server.fmt.stop_ids)
        for i, c in enumerate(self.choices):
            c.job = Job(tuple(prompt), max_new, sp, stop_ids, (base, i), feed(i))
        try:
            server.engine.submit([c.job for c in self.choices])
        except QueueFull as e:
            raise ApiError(f"the server is busy: {e}; retry later", status=429,
                           kind="rate_limit_error", code="server_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    def cancel(self) -> None:
        for c in self.choices:
            c.job.cancel()

    @property
    def done(self) -> bool:
        return all(c.finish for c in self.choices)

    async def next(self, timeout: float | None = None) -> tuple[int, Choice, int, int]:
        """The next event applied to its choice: (index, choice, token range it added)."""
        while True:
            i, ev = await asyncio.wait_for(self.queue.get(), timeout)
            added = self.choices[i].take(ev)
            if added is not None:
                return (i, self.choices[i], *added)

    def completion_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.choices)


async def wait_all(gen: Generation, request) -> None:
    """Every choice to its end; a client that disconnects cancels them (ClientGone)."""
    while not gen.done:
        try:
            await gen.next(DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                gen.cancel()
                raise ClientGone from None


class ClientGone(Exception):
    """The client closed its connection before its response."""


def _top_logprobs(policy, fmt: ChatFormat, prompt: list[int], c: Choice, k: int,
                  temperature: float):
    """[[(token text, logprob)] * k] per generated token, from a forward pass over prompt +
    completion (the sampler returns only the sampled token's log-probability), under its
    convention: log softmax(logits / T), T = 1 when greedy; top_p's renormalisation is not
    applied. Padded to a power of two (causal: the padding changes nothing before it) so
    the forward compiles for few lengths."""
    import jax

    ids = list(prompt) + c.tokens
    padded = np.zeros((1, bucket(len(ids), 16)), np.int32)
    padded[0, :len(ids)] = ids
    logits = np.asarray(policy.logits(padded))[0, len(prompt) - 1:len(ids) - 1]
    lp = np.asarray(jax.nn.log_softmax(logits / (temperature or 1.0), axis=-1))
    idx = np.argsort(-lp, axis=-1)[:, :k]
    return [[(fmt.decode([int(j)]), float(lp[i, j])) for j in idx[i]]
            for i in range(len(c.tokens))]


async def top_logprobs(server: Server, gen: Generation, c: Choice, s: api.Sampling):
    if not s.top_logprobs or not c.tokens:
        return None
    if server.engine.policy is None:
        raise ApiError("top_logprobs: the scripted policy has no distribution over tokens",
                       "top_logprobs")
    return await asyncio.to_thread(_top_logprobs, server.engine.policy, server.fmt, gen.prompt,
                                   c, s.top_logprobs, s.temperature)


async def chat_logprobs(server: Server, gen: Generation, c: Choice, s: api.Sampling):
    if not s.logprobs:
        return None
    pieces = [server.fmt.decode([t]) for t in c.tokens]
    return api.token_logprob_entries(pieces, c.logprobs, await top_logprobs(server, gen, c, s))


# routes


def visible(c: Choice, text: str, stops: tuple[str, ...], formats) -> int:
    """How much of a choice's `text` a stream may show now (never less than it has shown):
    all of it once the choice has ended; else not a trailing partial stop string, not from
    where a tool call may begin (`formats`: the call forms; None when no tools), not a
    trailing partial UTF-8 character."""
    if c.finish:
        return max(len(text), c.shown)
    upto = len(text) - api.stop_hold(text, stops)
    if formats is not None:
        upto = min(upto, api.call_start(text, formats))
    if text[:upto].endswith("\ufffd"):
        upto = c.shown
    return max(upto, c.shown)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _ids(s: api.Sampling, ids) -> list[int] | None:
    return list(ids) if s.return_token_ids else None


async def chat(server: Server, request, body):
    from starlette.responses import JSONResponse, StreamingResponse

    req = api.chat_request(body, (server.model,))
    prompt = chat_tokens(server, req)
    gen = Generation(server, prompt, req.sampling, "messages")
    tools = req.tools if req.tool_choice != "none" else ()
    if req.sampling.stream:
        return StreamingResponse(chat_stream(server, req, gen, tools),
                                 media_type="text/event-stream")
    await wait_all(gen, request)
    return JSONResponse(await chat_body(server, req, gen, tools))


async def chat_body(server: Server, req: api.ChatRequest, gen: Generation, tools) -> dict:
    """A chat.completion of the ended choices."""
    s, out = req.sampling, []
    for i, c in enumerate(gen.choices):
        content, calls = api.split_tool_calls(c.text(), tools, server.fmt.call_formats)
        out.append(api.chat_choice(i, content, calls, c.reason(),
                                   await chat_logprobs(server, gen, c, s), _ids(s, c.tokens)))
    body = {"id": api.new_id("chatcmpl"), "object": "chat.completion", "created": api.now(),
            "model": server.model, "choices": out,
            "usage": api.usage(len(gen.prompt), gen.completion_tokens())}
    if s.return_token_ids:
        body["prompt_token_ids"] = gen.prompt
    return body


async def chat_stream(server: Server, req: api.ChatRequest, gen: Generation, tools):
    """chat.completion.chunk events: a role chunk per choice (the first with the prompt's
    ids), then one chunk per engine event (its content delta and token ids), the last of a
    choice with its tool calls and finish_reason; usage if asked; [DONE]."""
    s, rid, created = req.sampling, api.new_id("chatcmpl"), api.now()
    formats = server.fmt.call_formats if tools else None

    def chunk(i, delta, finish=None, logprobs=None, ids=None):
        return _sse(api.chat_chunk(rid, server.model, created, i, delta, finish, logprobs,
                                   _ids(s, ids)))
    try:
        for i in range(s.n):
            first = api.chat_chunk(rid, server.model, created, i,
                                   {"role": "assistant", "content": ""})
            if s.return_token_ids and i == 0:
                first["prompt_token_ids"] = gen.prompt
            yield _sse(first)
        while not gen.done:
            i, c, a, b = await gen.next()
            text = c.text()
            upto = visible(c, text, s.stop, formats)
            lp = _event_logprobs(server, c, a, b) if s.logprobs else None
            if not c.finish:
                if upto > c.shown or b > a:
                    yield chunk(i, {"content": text[c.shown:upto]}, None, lp, c.tokens[a:b])
                    c.shown = upto
                continue
            content, calls = api.split_tool_calls(text, tools, server.fmt.call_formats)
            delta = {"content": content[c.shown:]} if content[c.shown:] else {}
            if calls:
                delta["tool_calls"] = [dict(tc, index=j) for j, tc in enumerate(calls)]
            yield chunk(i, delta, "tool_calls" if calls else c.reason(), lp, c.tokens[a:b])
        if s.include_usage:
            yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": server.model, "choices": [],
                        "usage": api.usage(len(gen.prompt), gen.completion_tokens())})
        yield "data: [DONE]\n\n"
    except ApiError as e:    # a generation that failed: the stream ends with the error
        yield _sse(e.body())
    finally:   # a client gone mid-stream: its rows are freed
        gen.cancel()


def _event_logprobs(server: Server, c: Choice, a: int, b: int) -> list[dict]:
    """The chat logprobs entries of tokens a:b of a choice (no top_logprobs when streamed)."""
    return api.token_logprob_entries([server.fmt.decode([t]) for t in c.tokens[a:b]],
                                     c.logprobs[a:b], None)


async def completions(server: Server, request, body):
    from starlette.responses import JSONResponse, StreamingResponse

    req = api.completion_request(body, (server.model,))
    prompt = completion_tokens(server.fmt, req, server.vocab_size)
    gen = Generation(server, prompt, req.sampling, "prompt")
    if req.sampling.stream:
        return StreamingResponse(completion_stream(server, req, gen),
                                 media_type="text/event-stream")
    await wait_all(gen, request)
    return JSONResponse(await completion_body(server, req, gen))


def _completion(server: Server, rid: str, created: int, choices: list[dict], **extra) -> dict:
    return {"id": rid, "object": "text_completion", "created": created,
            "model": server.model, "choices": choices, **extra}


async def completion_body(server: Server, req: api.CompletionRequest, gen: Generation) -> dict:
    """A text_completion of the ended choices (with the prompt's text where echo)."""
    s, head, out = req.sampling, server.fmt.decode(gen.prompt) if req.echo else "", []
    for i, c in enumerate(gen.choices):
        lp = None
        if s.logprobs:
            lp = api.completion_logprobs([server.fmt.decode([t]) for t in c.tokens],
                                         c.logprobs, await top_logprobs(server, gen, c, s),
                                         len(head))
        out.append({"index": i, "text": head + c.text(), "finish_reason": c.reason(),
                    "logprobs": lp, **({"token_ids": c.tokens} if s.return_token_ids else {})})
    extra = {"prompt_token_ids": gen.prompt} if s.return_token_ids else {}
    return _completion(server, api.new_id("cmpl"), api.now(), out,
                       usage=api.usage(len(gen.prompt), gen.completion_tokens()), **extra)


async def completion_stream(server: Server, req: api.CompletionRequest, gen: Generation):
    """text_completion events: one per engine event (a choice's text delta and token ids;
    the first with the prompt's ids, each choice's first with the echoed prompt); usage if
    asked; [DONE]."""
    s, rid, created = req.sampling, api.new_id("cmpl"), api.now()
    head = server.fmt.decode(gen.prompt) if req.echo else ""
    started = set()
    try:
        while not gen.done:
            i, c, a, b = await gen.next()
            text = c.text()
            upto = visible(c, text, s.stop, None)
            if not (c.finish or upto > c.shown or b > a):
                continue
            choice = {"index": i, "text": ("" if i in started else head) + text[c.shown:upto],
                      "finish_reason": c.reason() if c.finish else None, "logprobs": None}
            if s.logprobs:
                choice["logprobs"] = api.completion_logprobs(
                    [server.fmt.decode([t]) for t in c.tokens[a:b]], c.logprobs[a:b], None)
            if s.return_token_ids:
                choice["token_ids"] = c.tokens[a:b]
            extra = {"prompt_token_ids": gen.prompt} if s.return_token_ids and not started else {}
            started.add(i)
            c.shown = upto
            yield _sse(_completion(server, rid, created, [choice], **extra))
        if s.include_usage:
            yield _sse(_completion(server, rid, created, [],
                                   usage=api.usage(len(gen.prompt), gen.completion_tokens())))
        yield "data: [DONE]\n\n"
    except ApiError as e:
        yield _sse(e.body())
    finally:
        gen.cancel()


def _error_response(e: ApiError):
    from starlette.responses import JSONResponse
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def build_app(server: Server | None, sessions: Sessions | None = None):
    """The Starlette application of `server` (None: no plain serving), with the routes of
    harness `sessions` where given (a session's id is its credential: no API key)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def handler(fn, authenticated=True):
        async def endpoint(request):
            try:
                if authenticated and server is not None:
                    check_key(server, request)
                body = await read_json(request) if request.method == "POST" else None
                return await fn(server, request, body)
            except ApiError as e:
                return _error_response(e)
            except ClientGone:
                return Response(status_code=499)
            except Exception as e:   # noqa: BLE001 - one request's failure, not the server's
                log.exception("request %s", request.url.path)
                return _error_response(ApiError(f"internal error: {e!r}"[:300], status=500,
                                                kind="server_error"))
        return endpoint

    async def models(server, request, body):
        return JSONResponse({"object": "list", "data": [
            {"id": server.model, "object": "model", "created": 0, "owned_by": "supo-jax",
             "max_model_len": server.engine.max_len}]})

    async def health(server, request, body):
        e = server.engine
        ok = e.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped", "rows": e.rows,
                             "free_rows": e.free_rows, "waiting": len(e.waiting)},
                            status_code=200 if ok else 503)

    async def not_found(request, exc: HTTPException):
        return _error_response(ApiError(f"{exc.detail}: {request.method} {request.url.path}",
                                        status=exc.status_code))

    routes = [] if server is None else [
        Route("/health", handler(health, authenticated=False), methods=["GET"]),
        Route("/v1/models", handler(models), methods=["GET"]),
        Route("/v1/chat/completions", handler(chat), methods=["POST"]),
        Route("/v1/completions", handler(completions), methods=["POST"])]
    if sessions is not None:
        def of(fn):
            return handler(lambda _, request, body: fn(sessions, request, body),
                           authenticated=False)
        routes += [Route("/sessions/{sid}/v1/chat/completions", of(session_chat),
                         methods=["POST"]),
                   Route("/sessions/{sid}/v1/models", of(session_models), methods=["GET"]),
                   Route("/sessions/next", of(session_next), methods=["GET"]),
                   Route("/sessions/{sid}/reward", of(session_reward), methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


# running it


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one): connections queue from now on, before
    the server runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


# seconds an idle keep-alive connection stays open: longer than clients keep theirs (httpx's
# pool, which the openai SDK uses: 5 s; aiohttp: 15 s), so that the client drops an idle
# connection first; at uvicorn's own 5 s a request sent on a connection the server was
# closing at that moment failed as a connection error (a client without retries, as tau2's
# runs use, fails its conversation)
KEEP_ALIVE_S = 75


def _uvicorn(app, **options):
    import uvicorn
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                         timeout_keep_alive=KEEP_ALIVE_S, **options))


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def serve(server: Server, sock: socket.socket) -> None:
    """Serve on `sock` until SIGTERM or SIGINT (uvicorn's graceful shutdown: no new
    connections, the requests in flight finish), then stop the engine. On the main thread,
    SIGTERM is a normal end: uvicorn raises the signal again once it has shut down, and
    this handler takes it (the process exits 0, not killed by it)."""
    import signal

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
    try:
        _uvicorn(build_app(server)).run(sockets=[sock])
    finally:
        server.engine.close()
        sock.close()
        if main:
            signal.signal(signal.SIGTERM, previous)


class Running:
    """A uvicorn server of `app` on a thread (tests): `url`, then `stop()`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.sock = listen(host, port)
        self.url = url_of(self.sock)
        self.server = _uvicorn(app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name="uvicorn")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
