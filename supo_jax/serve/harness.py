"""Harness mode: an agent in its own loop, speaking the OpenAI API, as an environment of the
rollout driver (docs/HARNESS.md).

A harness is a function `episode(task: dict, client: openai.OpenAI, model: str) -> float`:
it runs one episode of `task` against `client` and returns the reward. HarnessEnv runs it in
a thread of its own per rollout, its client pointed at a session of this server
(`{url}/sessions/{id}/v1`), and turns its requests into the driver's environment calls:

    reset(task)  -> the harness starts; its first request ([system,] user, tools; an
                    assistant greeting before the user's message is folded into it:
                    sessions.first_turn) is the initial prompt s1
    act(action)  -> the pending request is answered with the action (its tool calls read by
                    the policy's parser); the harness's next request's new messages (tool
                    results, or a user turn) are the observation, or its return ends the
                    episode with its reward

A harness of None is out of process (any language, HTTP alone): reset offers the session
and its task to the next harness process that claims one (GET /sessions/next), and the
harness's POST /sessions/{id}/reward is its return (docs/HARNESS.md, "The session
protocol"). A session no process claims within `timeout_s` times out.

So the driver, its context manager (summaries included: one happens between two requests,
and the pending request is answered by the first action after the reset), its segments and
its rows are the built-in loop's; the harness never sees the working context. A harness
that rewrites its history, raises, returns a reward that is not a finite number, or stays
silent past `timeout_s` fails its rollout (env_error / timeout, recorded), never the run.
"""
from __future__ import annotations

import contextlib
import math
import os
import queue
import subprocess
import tempfile
import threading
from typing import Callable

from supo_jax.envs.base import Environment, Reset, StepResult, ToolSpec
from supo_jax.serve.api import ApiError
from supo_jax.serve.sessions import (Session, Sessions, extend_history, first_turn, new_turn,
                                     reply, rewrite, session_error)

Harness = Callable[[dict, object, str], float]


class HarnessFailed(RuntimeError):
    """The harness failed its rollout; `rollout_reason` is the driver's reason for it."""

    def __init__(self, message: str, reason: str = "env_error"):
        super().__init__(message)
        self.rollout_reason = reason


def _reward(value) -> float:
    """The harness's return as a reward: a finite number, else HarnessFailed."""
    try:
        r = float(value)
    except (TypeError, ValueError):
        raise HarnessFailed(f"the harness returned {value!r}: a reward (a number) "
                            "expected") from None
    if not math.isfinite(r):
        raise HarnessFailed(f"the harness returned a reward of {r}: a finite number expected")
    return r


def _sampling_set(req) -> bool:
    """Whether a request asks for sampling settings of its own (ignored: the run's hold)."""
    s = req.sampling
    return (s.temperature != 1.0 or s.top_p != 1.0 or s.max_tokens is not None or bool(s.stop)
            or s.seed is not None or s.ignore_eos)


_HTTP = None
_HTTP_LOCK = threading.Lock()


def _shared_http():
    """The process's HTTP client for in-process harnesses' sessions (built once): one
    connection pool, no limit on connections (a session each), TCP_NODELAY (the client
    writes a request's headers and body apart: with Nagle's algorithm the body waits for
    the server's delayed ACK, 40 ms a request on Linux)."""
    global _HTTP
    with _HTTP_LOCK:
        if _HTTP is None:
            import socket

            import httpx2
            import openai
            _HTTP = openai.DefaultHttpxClient(transport=httpx2.HTTPTransport(
                limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None),
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]))
        return _HTTP


class HarnessEnv(Environment):
    """One rollout of `harness` through a session of `sessions`, served at `url` (the
    server's root, e.g. app.Running(...).url); `harness` None: a harness process claims the
    session over HTTP and reports its reward by a POST. timeout_s: how long the harness may take to
    send its next request (or return) after an answer; past it the rollout times out (the
    driver's env_timeout_s bounds the same wait: the shorter one decides)."""
    name = "harness"

    def __init__(self, harness: Harness | None, sessions: Sessions, url: str,
                 timeout_s: float = 300.0, request_timeout_s: float = 3600.0):
        super().__init__()
        self.harness, self.sessions, self.url = harness, sessions, url.rstrip("/")
        self.timeout_s, self.request_timeout_s = timeout_s, request_timeout_s
        self.session: Session | None = None
        self.tools: tuple[ToolSpec, ...] = ()
        self.requests = self.sampling_ignored = self.rewritten = 0
        self.retemplated: set[int] = set()

    # the harness's thread

    def _play(self, task: dict, s: Session) -> None:
        import openai

        # the sessions' clients share one connection pool (an HTTP client of its own costs
        # each session ~20 ms of CPU to build); closing a client leaves the pool open
        client = openai.OpenAI(base_url=f"{self.url}/sessions/{s.id}/v1", api_key="harness",
                               max_retries=0, timeout=self.request_timeout_s,
                               http_client=_shared_http())
        try:
            s.finished("returned", self.harness(task, client, s.model))
        except BaseException as e:  # noqa: BLE001 - reported to the rollout, not raised here
            s.finished("raised", e)

    # the driver's calls (in its pool's threads)

    def reset(self, task: dict) -> Reset:
        s = self.session = self.sessions.open()
        if self.harness is None:
            self.sessions.offer(s, task)
            if not s.claimed.wait(self.timeout_s):
                raise self._fail(session_error("no harness process claimed the session in "
                                               "time", 408, "harness_timeout"), "timeout")
        else:
            threading.Thread(target=self._play, args=(task, s), daemon=True,
                             name=f"harness-{s.id[:8]}").start()
        req = self._next_request()
        try:
            system, prompt = first_turn(req.messages)
        except ApiError as e:
            raise self._fail(e) from None
        s.held, s.tools = list(req.messages), req.tools
        self.tools = tuple(ToolSpec(t["function"]["name"], t["function"]["description"],
                                    t["function"]["parameters"]) for t in req.tools)
        self._count(req)
        return Reset(prompt=prompt, tools=list(self.tools), system=system)

    def act(self, text: str) -> StepResult:
        """Answer the pending request with the action; the harness's next request's new
        messages are the observation, its return the episode's end."""
        s = self.session
        held, body = reply(text, s.tools if self._tool_choice != "none" else (),
                           self.call_formats, s.model)
        s.held.append(held)
        s.answer(body)
        info = {"tool_call": bool(held["tool_calls"])}
        event = self._next_request(returns=True)
        if not isinstance(event, float):
            return StepResult(self._observe(event), role=self._role, info=info)
        self.sessions.close(s, session_error("the episode has ended", 410, "session_ended"))
        return StepResult("", done=True, reward=event, info={**info, **self.telemetry()})

    def step(self, name: str, arguments: dict) -> StepResult:
        raise NotImplementedError("a harness runs its own tools: HarnessEnv.act answers it")

    def release(self) -> None:
        """The rollout ended (the driver's hook): a request still in flight, and any later
        one, is answered with an error."""
        if self.session is not None:
            self.sessions.close(self.session, session_error(
                "the rollout of this session has ended on the server", 410, "session_ended"))

    def telemetry(self) -> dict:
        """Counters of the session (the rollout's env_info when it ends)."""
        return {"requests": self.requests, "retemplated": len(self.retemplated),
                "rewritten": self.rewritten, "sampling_ignored": self.sampling_ignored}

    # helpers

    def _count(self, req) -> None:
        self.requests += 1
        self.sampling_ignored += _sampling_set(req)
        self._tool_choice = req.tool_choice

    def _next_request(self, returns: bool = False):
        """The harness's next request (or, where `returns`, its reward as a float when it
        returned); HarnessFailed on anything else."""
        try:
            kind, value = self.session.next_event(self.timeout_s)
        except queue.Empty:
            raise self._fail(session_error("the harness sent no request in time", 408,
                                           "harness_timeout"), "timeout") from None
        if kind == "request":
            return value
        if kind == "returned" and returns:
            try:
                return _reward(value)
            except HarnessFailed as e:
                raise self._fail(session_error(str(e), 410, "session_ended")) from None
        if kind == "returned":
            msg = "the harness returned before its first request"
        elif kind == "raised":
            msg = f"the harness raised {value!r}"[:400]
        else:
            msg = f"the session ended: {value.message}"
        raise self._fail(session_error(msg, 410, "session_ended"))

    def _observe(self, req) -> str:
        """The observation of a request: the new messages after what the session holds."""
        s = self.session
        try:
            if req.tools != s.tools:
                raise rewrite("its tools are not the session's (the first request's)")
            new, retemplated = extend_history(s.held, req.messages)
            text, self._role = new_turn(new)
        except ApiError as e:
            raise self._fail(e) from None
        s.held += new
        self.retemplated |= retemplated
        self._count(req)
        return text

    def _fail(self, error: ApiError, reason: str = "env_error") -> HarnessFailed:
        """End the session with `error` (the harness's request in flight gets it) and name
        the rollout's failure."""
        self.rewritten += error.code == "history_rewritten"
        self.sessions.close(self.session, error)
        return HarnessFailed(f"harness session: {error.message}", reason)


def harness_envs(harness: Harness | None, sessions: Sessions, url: str,
                 **kwargs) -> Callable[[], HarnessEnv]:
    """make_env for the driver (run_rollouts, rollout_phase): a HarnessEnv per rollout
    (`harness` None: out of process)."""
    return lambda: HarnessEnv(harness, sessions, url, **kwargs)


@contextlib.contextmanager
def harness_mode(cfg):
    """A run of `cfg` (a Config) in harness mode (env.harness): one sessions server for the run
    on 127.0.0.1 at env.harness_port (0: a free port); within, the trainer's rollouts
    (training and evals) are sessions of the harness. Yields the server's URL, which an
    out-of-process harness (env.harness="http") is told on stdout.

        with harness_mode(cfg):
            train(cfg)
    """
    from supo_jax.config import load_harness
    from supo_jax.rl.trainer import harness_envs_installed
    from supo_jax.serve.app import Running, build_app

    harness = load_harness(cfg.env)
    sessions = Sessions()
    server = Running(build_app(None, sessions), port=cfg.env.harness_port)
    if harness is None:
        print(f"harness sessions: {server.url}/sessions/next", flush=True)
    bridge = None
    try:
        if cfg.env.harness.startswith(("verifiers:", "tau2:")):
            bridge = verifiers_bridge(cfg, server.url)
        with harness_envs_installed(harness_envs(harness, sessions, server.url,
                                                 timeout_s=cfg.env.timeout_s)):
            yield server.url
    finally:
        sessions.shutdown()
        if bridge is not None:
            bridge.stop()
        server.stop()


class VerifiersBridge:
    """The bridge process of env.harness="verifiers:MODULE:FUNCTION" (supo_jax/harnesses/
    verifiers_bridge.py) or "tau2:DOMAIN" (supo_jax/harnesses/tau2_bridge.py; `name` "tau2
    bridge"), run by the harnesses' venv's python from the working directory: started once
    its environment is loaded (its first line, "{name}: ..."), stopped at the run's end."""

    def __init__(self, argv: list[str], start_timeout_s: float = 300.0,
                 name: str = "verifiers bridge"):
        from supo_jax.config import ConfigError

        self.err = tempfile.TemporaryFile("w+")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env=env)
        self.line = self.proc.stdout.readline()   # "verifiers bridge: ... claims ...", or EOF
        if not self.line.startswith(f"{name}:"):
            self.proc.wait(timeout=start_timeout_s)
            self.err.seek(0)
            lines = [ln for ln in self.err.read().splitlines() if ln.strip()]
            self.err.close()
            raise ConfigError(f"env.harness: the {name} stopped at start (status "
                              f"{self.proc.returncode}): {(lines or [''])[-1].strip()[:500]}")
        print(self.line.strip(), flush=True)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for _ in self.proc.stdout:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()


def verifiers_bridge(cfg, url: str) -> VerifiersBridge:
    """Start the bridge of cfg.env.harness ("verifiers:MODULE:FUNCTION", or "tau2:DOMAIN")
    against the sessions server at `url`, `rollout.rows` sessions at a time
    (SUPO_JAX_VERIFIERS_LOG: its JSON log of each session, appended)."""
    from supo_jax.config import verifiers_python
    python = verifiers_python(cfg.env)
    kind, spec = cfg.env.harness.split(":", 1)
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "harnesses", f"{kind}_bridge.py")
    argv = [python, script, url, spec, "--workers", str(max(1, cfg.rollout.rows))]
    if os.environ.get("SUPO_JAX_VERIFIERS_LOG"):
        argv += ["--log", os.environ["SUPO_JAX_VERIFIERS_LOG"]]
    return VerifiersBridge(argv, name=f"{kind} bridge")
