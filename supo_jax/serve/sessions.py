"""Harness sessions: one rollout's conversation, held by the server, met request by request.

A harness (docs/HARNESS.md) keeps its own loop and its own message history and sends the
whole history with every request to `/sessions/{id}/v1/chat/completions`. The server keeps
what it holds of that conversation (`Session.held`) and reads each request against it,
message by message (`extend_history`, a pure function):

- a system, user or tool message must be the one the harness sent before, word for word;
- an assistant message must be the one the server answered with: the same tool calls (name
  and arguments, compared as JSON values), its content the same, or (a re-templated turn:
  counted, not a fork) other content around the same calls, or for a reply without calls its
  content trimmed of leading text or whitespace (stripped reasoning). The server never reads
  the tokens of an assistant message back: the rollout keeps the ids it sampled;
- what follows the held conversation is the turn's new messages: tool results, or a new user
  turn (`new_turn`), rendered once by the driver as the observation.

Anything else (a dropped, edited or reordered turn, an assistant message the server did not
send, other tools) is a rewrite: the request gets a 409 and the rollout fails, recorded; it
is never trained on as if the policy had seen it.

A Session is a mailbox between two threads: the HTTP route hands it a request (`ask`, a
future the route awaits) and the rollout's environment (supo_jax.serve.harness.HarnessEnv)
takes the requests and the harness's end (`next_event`) and answers (`answer`, `end`).

An out-of-process harness (any language) opens no session itself: the rollout offers its
session (`Sessions.offer`), a harness process claims it (`GET /sessions/next`, long-polled:
its id, base URL, model and task) and ends it with its reward (`POST /sessions/{id}/reward`,
`Session.report`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import collections
import json
import math
import queue
import threading
import uuid

from supo_jax.serve import api
from supo_jax.serve.api import ApiError

NO_RETRY = {"x-should-retry": "false"}   # the openai SDK's own header: do not retry this


def session_error(message: str, status: int, code: str, param: str | None = None) -> ApiError:
    """An error answer of a session (the openai SDK is told not to retry it)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(message, param, status=status, kind=kind, code=code, headers=dict(NO_RETRY))


def rewrite(message: str) -> ApiError:
    return session_error(f"the request rewrites the conversation this session holds: {message}",
                         409, "history_rewritten", "messages")


# reading a request against the conversation held (pure)


def _calls(m: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", ())]


def same_turn(held: dict, got: dict) -> str | None:
    """How a request's message `got` stands to the message the session holds at its place:
    "same", "retemplated" (an assistant message the server sent, re-templated by the
    harness: the same calls with other content or key order, or a reply without calls
    trimmed of leading text), or None (a rewrite)."""
    if held["role"] != got["role"]:
        return None
    if held["role"] != "assistant":
        return "same" if held["content"] == got["content"] else None
    mine, theirs = _calls(held), _calls(got)
    if mine != theirs:
        return None
    if held["content"] == got["content"] and [json.dumps(a) for _, a in mine] == [
            json.dumps(a) for _, a in theirs]:
        return "same"
    if mine:
        return "retemplated"
    text = got["content"].strip()
    return "retemplated" if text and held["content"].strip().endswith(text) else None


def extend_history(held: list[dict], messages) -> tuple[list[dict], set[int]]:
    """(the request's messages after the held conversation, the places of the held turns it
    re-templates); an ApiError 409 where the request does not extend what the session
    holds."""
    if len(messages) < len(held):
        raise rewrite(f"it holds {len(messages)} messages, fewer than the {len(held)} of the "
                      "session (turns were dropped)")
    retemplated = set()
    for i, (h, m) in enumerate(zip(held, messages)):
        how = same_turn(h, m)
        if how is None:
            raise rewrite(f"messages[{i}] ({m['role']}) is not the {h['role']} message "
                          "the session holds there")
        if how == "retemplated":
            retemplated.add(i)
    return list(messages[len(held):]), retemplated


def new_turn(new: list[dict]) -> tuple[str, str]:
    """(observation text, role) of a turn's new messages: tool results (several are joined
    by newlines, as an environment's several calls are) or a user turn."""
    if not new:
        raise session_error("the request adds no message to the conversation: a harness "
                            "sends its history and the turn's tool results or user message",
                            400, "no_new_message", "messages")
    roles = {m["role"] for m in new}
    if "assistant" in roles:
        raise rewrite("it adds an assistant message the server did not send")
    if len(roles) > 1 or not roles <= {"tool", "user"}:
        raise session_error(
            f"the request adds messages of roles {sorted(roles)}: a turn adds tool results or "
            "user messages, not both (other mixes are not built)", 400, "unsupported_turn",
            "messages")
    return "\n".join(m["content"] for m in new), roles.pop()


def first_turn(messages) -> tuple[str | None, str]:
    """(system, prompt) of a session's first request: [system,] [assistant...,] user. An
    assistant message before the first user message (a harness's canned greeting, e.g.
    tau2-bench's agent's "Hi! How can I help you today?") was not sampled: it is context of
    the initial prompt s1, not trained, folded into the prompt before the user's message as
    "Assistant: {content}" (blank lines between); it may not make tool calls."""
    roles = [m["role"] for m in messages]
    body = roles[1:] if roles[:1] == ["system"] else roles
    if (not body or body[-1] != "user" or set(body[:-1]) - {"assistant"}
            or any(m.get("tool_calls") for m in messages if m["role"] == "assistant")):
        raise session_error(f"a session's first request holds [system,] [assistant...,] user "
                            f"messages (the assistant ones without tool calls); this one holds "
                            f"{roles}", 400, "unsupported_first_request", "messages")
    said = [f"Assistant: {m['content']}" for m in messages if m["role"] == "assistant"]
    system = messages[0]["content"] if roles[0] == "system" else None
    return system, "\n\n".join(said + [messages[-1]["content"]])


def reply(text: str, tools, formats, model: str) -> tuple[dict, dict]:
    """(the assistant message as the session holds it, the chat.completion body) of a
    policy's action text: its tool calls read by the policy's own parser."""
    content, calls = api.split_tool_calls(text, tools, formats)
    choice = api.chat_choice(0, content, calls, "stop", None, None)
    held = {"role": "assistant", "content": content, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {
            "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in calls]}
    body = {"id": api.new_id("chatcmpl"), "object": "chat.completion", "created": api.now(),
            "model": model, "choices": [choice]}
    return held, body


# the mailbox


class Session:
    """One rollout's conversation. `held`: the messages the server holds (normalized as
    api.messages_of does); `tools`: the first request's tools."""

    def __init__(self, sid: str, model: str):
        self.id, self.model = sid, model
        self.held: list[dict] = []
        self.tools: tuple[dict, ...] = ()
        self.task: dict | None = None             # an offered session's task
        self.claimed = threading.Event()          # an offered session's claim by a harness
        self._events: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting: cf.Future | None = None   # the request not answered yet
        self._ended: ApiError | None = None

    def ask(self, req: api.ChatRequest) -> cf.Future:
        """A request from the harness (the HTTP side): a future of its response body."""
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._ended is not None:
                fut.set_exception(self._ended)
                return fut
            if self._waiting is not None:
                fut.set_exception(session_error(
                    "the session has a request in flight: one request at a time", 409,
                    "request_in_flight"))
                return fut
            self._waiting = fut
        self._events.put(("request", req))
        return fut

    def finished(self, kind: str, value) -> None:
        """The harness's end (its thread): "returned" with its value, or "raised"."""
        self._events.put((kind, value))

    def next_event(self, timeout: float) -> tuple[str, object]:
        """The next of: ("request", ChatRequest), ("returned", value), ("raised", exception),
        ("ended", ApiError); queue.Empty after `timeout` seconds."""
        return self._events.get(timeout=timeout)

    def answer(self, result) -> None:
        """Answer the request in flight: a response body, or an ApiError."""
        with self._lock:
            fut, self._waiting = self._waiting, None
        if fut is not None and not fut.done():
            (fut.set_exception if isinstance(result, ApiError) else fut.set_result)(result)

    def report(self, reward: float) -> None:
        """The reward of an out-of-process harness (its POST): its episode returned. Later
        requests get a 410; a session already ended raises its end's error."""
        with self._lock:
            if self._ended is not None:
                raise self._ended
            self._ended = session_error("the episode has ended: its reward was reported", 410,
                                        "session_ended")
        self._events.put(("returned", reward))

    def end(self, error: ApiError) -> ApiError:
        """No more requests: the one in flight and every later one get `error`; a wait in
        next_event wakes. Idempotent: the first error stays (returned)."""
        with self._lock:
            if self._ended is not None:
                return self._ended
            self._ended = error
        self.answer(error)
        self._events.put(("ended", error))
        return error


class Sessions:
    """The open sessions of a server, by id (a random, unguessable id: it is the session's
    only credential; its first 8 hex digits name this Sessions, the server's run, so that a
    session of an earlier run, killed and started again, is told apart: `lost`).
    Thread-safe."""

    GONE = 4096   # ended sessions whose end is remembered (a later request gets its error)

    def __init__(self, model: str = "policy"):
        self.model = model
        self.instance = uuid.uuid4().hex[:8]
        self._open: dict[str, Session] = {}
        self._gone: collections.OrderedDict[str, ApiError] = collections.OrderedDict()
        self._offers: collections.deque[Session] = collections.deque()   # not claimed yet
        self._claims: collections.deque[cf.Future] = collections.deque()  # claims waiting
        self._shut = False
        self._lock = threading.Lock()

    def open(self) -> Session:
        s = Session(self.instance + uuid.uuid4().hex[:24], self.model)
        with self._lock:
            self._open[s.id] = s
        return s

    def get(self, sid: str) -> Session | None:
        with self._lock:
            return self._open.get(sid)

    def gone(self, sid: str) -> ApiError | None:
        """The error that ended session `sid` (None: unknown, or ended long ago)."""
        with self._lock:
            return self._gone.get(sid)

    def lost(self, sid: str) -> bool:
        """Whether `sid` is a session id of another run of the server (one killed and
        started again): its rollout is redone by this run, under a new session."""
        return (len(sid) == 32 and not sid.startswith(self.instance)
                and all(c in "0123456789abcdef" for c in sid))

    def close(self, s: Session, error: ApiError) -> ApiError:
        """End `s` with `error` (see Session.end; the error that stands is returned); later
        requests get that error (a 404 once GONE more sessions have ended)."""
        error = s.end(error)
        with self._lock:
            if self._open.pop(s.id, None) is not None:
                self._gone[s.id] = error
                while len(self._gone) > self.GONE:
                    self._gone.popitem(last=False)
        return error

    # out-of-process harnesses: a rollout offers its session, a harness process claims it

    def offer(self, s: Session, task: dict) -> None:
        """Offer open session `s` of `task` to the next claim (one waiting, or the next)."""
        with self._lock:
            s.task = task
            while self._claims:
                fut = self._claims.popleft()
                if fut.set_running_or_notify_cancel():   # False: the claim gave up
                    s.claimed.set()
                    fut.set_result(s)
                    return
            self._offers.append(s)

    def claim(self) -> cf.Future:
        """A future of the next session offered (sessions ended meanwhile are skipped), or of
        None once the server shuts down; a claim that gives up cancels it."""
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._shut:
                fut.set_running_or_notify_cancel()
                fut.set_result(None)
                return fut
            while self._offers:
                s = self._offers.popleft()
                if s.id in self._open:
                    s.claimed.set()
                    fut.set_running_or_notify_cancel()
                    fut.set_result(s)
                    return fut
            self._claims = collections.deque(f for f in self._claims if not f.cancelled())
            self._claims.append(fut)
        return fut

    def shutdown(self) -> None:
        """The server stops: claims waiting, and later ones, get None at once (a 204), so
        that no long poll holds the server's shutdown."""
        with self._lock:
            self._shut = True
            claims, self._claims = self._claims, collections.deque()
        for fut in claims:
            if fut.set_running_or_notify_cancel():
                fut.set_result(None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


# the routes (supo_jax.serve.app registers them)


def _session(sessions: Sessions, request) -> Session:
    """The open session of the request's path; its end's error for one that ended, a 404
    for an unknown one."""
    sid = request.path_params["sid"]
    s = sessions.get(sid)
    if s is None:
        if sessions.lost(sid):
            raise ApiError(
                "this session belongs to an earlier run of the server, which restarted (a "
                "resumed run redoes the rollouts it had in flight): the episode is void; "
                "claim the next session at /sessions/next", None, status=503,
                kind="server_error", code="session_lost", headers=dict(NO_RETRY))
        raise sessions.gone(sid) or session_error(f"unknown session {sid[:64]!r}", 404,
                                                  "session_not_found")
    return s


async def session_chat(sessions: Sessions, request, body):
    """POST /sessions/{sid}/v1/chat/completions: the request handed to its session; the
    answer is the policy's next action (or the session's error)."""
    from starlette.responses import JSONResponse

    s = _session(sessions, request)
    req = api.chat_request(body, (s.model,))
    if req.sampling.stream:
        raise session_error("streaming is not built for harness sessions", 400,
                            "unsupported", "stream")
    if req.sampling.n != 1:
        raise session_error("a harness session answers one choice (n = 1)", 400,
                            "unsupported", "n")
    return JSONResponse(await asyncio.wrap_future(s.ask(req)))


async def session_models(sessions: Sessions, request, body):
    """GET /sessions/{sid}/v1/models: the model a session serves."""
    from starlette.responses import JSONResponse

    s = _session(sessions, request)
    return JSONResponse({"object": "list", "data": [
        {"id": s.model, "object": "model", "created": 0, "owned_by": "supo-jax"}]})


MAX_WAIT_S = 300.0


async def session_next(sessions: Sessions, request, body):
    """GET /sessions/next?wait=S: the next session a rollout offers to an out-of-process
    harness, {"id", "base_url", "model", "task"}, waiting up to S seconds (default 30, at
    most MAX_WAIT_S) for one; 204 (no body) when none came."""
    from starlette.responses import JSONResponse, Response

    try:
        wait = min(max(float(request.query_params.get("wait", "30")), 0.0), MAX_WAIT_S)
    except ValueError:
        raise session_error("wait is a number of seconds", 400, "invalid_wait", "wait") from None
    fut = sessions.claim()
    try:
        s = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), wait)
    except asyncio.TimeoutError:
        if fut.cancel():
            return Response(status_code=204)
        s = fut.result()      # an offer took the claim as it gave up
    except asyncio.CancelledError:   # the client left: the session goes to the next claim
        if not fut.cancel() and fut.result() is not None:
            sessions.offer(fut.result(), fut.result().task)
        raise
    if s is None:             # the server shuts down
        return Response(status_code=204)
    base = str(request.base_url).rstrip("/")
    return JSONResponse({"id": s.id, "base_url": f"{base}/sessions/{s.id}/v1",
                         "model": s.model, "task": s.task})


def _finite(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


async def session_reward(sessions: Sessions, request, body):
    """POST /sessions/{sid}/reward {"reward": <finite number>}: an out-of-process harness's
    episode ends with its reward. Any other body fails the rollout (400 invalid_reward)."""
    from starlette.responses import JSONResponse

    s = _session(sessions, request)
    reward = body.get("reward") if isinstance(body, dict) else None
    if not _finite(reward):
        raise sessions.close(s, session_error(
            f"the reward must be a finite number, got {json.dumps(body)[:80]}: the rollout "
            "fails", 400, "invalid_reward", "reward"))
    s.report(float(reward))
    return JSONResponse({"id": s.id, "reward": float(reward)})
