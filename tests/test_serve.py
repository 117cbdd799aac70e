"""`supo-jax serve`'s OpenAI-compatible endpoint (supo_jax.serve), driven by the official
`openai` SDK and by raw HTTP: a tiny random policy behind the engine, in this process.

A second app serves the same chat format from a scripted engine (it "samples" a fixed
tool call), so the tool-call path is checked without a trained policy."""
import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from supo_jax.agent.render import ChatFormat
from supo_jax.model.policy import new_policy
from supo_jax.model.tiny import tiny_config, tiny_tokenizer
from supo_jax.sampling.sampler import SamplingParams, generate
from supo_jax.serve import api
from supo_jax.serve.app import MAX_BODY_BYTES, Running, Server, build_app
from supo_jax.serve.engine import Engine, Event, Job

pytestmark = pytest.mark.xdist_group("test_serve")

ROWS, MAX_LEN, QUEUE = 4, 256, 16
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "the value of a key",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                   "required": ["key"]}}}]
CALL = 'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "k17"}}\n</tool_call>'


class Slow:
    """Slows the engine's decode calls while on (a generation then outlasts a client)."""

    def __init__(self, engine):
        self.on, self.delay, advance = False, 0.1, engine.sampler.advance

        def slow_advance(*a, **k):
            if self.on:
                time.sleep(self.delay)
            return advance(*a, **k)
        engine.sampler.advance = slow_advance


class ScriptedEngine:
    """The engine's interface, answering every job with CALL's tokens in two events."""

    rows, queue_limit, max_len, free_rows, waiting = 1, 4, 4096, 1, ()

    def __init__(self, fmt, policy):
        self.tokens = fmt.encode(CALL) + [fmt.stop_id]
        self.policy, self.thread = policy, threading.main_thread()

    def submit(self, jobs):
        half = len(self.tokens) // 2
        for j in jobs:
            j.on_event(Event(tuple(self.tokens[:half]), (-0.5,) * half))
            rest = self.tokens[half:]
            j.on_event(Event(tuple(rest), (-0.5,) * len(rest), "stop"))


@pytest.fixture(scope="module")
def served():
    tok = tiny_tokenizer(template="compact")
    fmt = ChatFormat(tok)
    policy = new_policy(tiny_config("qwen2", vocab_size=len(tok)), seed=0, tokenizer=tok)
    engine = Engine(policy, rows=ROWS, max_len=MAX_LEN, queue=QUEUE)
    slow = Slow(engine)
    main = Running(build_app(Server(engine, fmt, "tiny")))
    scripted = Running(build_app(Server(ScriptedEngine(fmt, policy), fmt, "tiny",
                                        api_key="secret")))
    yield {"url": main.url, "engine": engine, "slow": slow, "fmt": fmt, "policy": policy,
           "scripted": scripted.url}
    main.stop()
    scripted.stop()
    engine.close()


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def ask(url, text="Hi", **kw):
    return client(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], **kw)


def test_models_and_health(served):
    assert [m.id for m in client(served["url"]).models.list().data] == ["tiny"]
    h = httpx.get(served["url"] + "/health").json()
    assert h["status"] == "ok" and h["rows"] == ROWS


def test_tool_calls_over_two_turns(served):
    c = client(served["scripted"], "secret")
    msgs = [{"role": "user", "content": "What is k17?"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me look."
    (call,) = ch.message.tool_calls
    assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"key": "k17"}
    # streamed: the content before the call, then the call; the same finish
    parts = list(c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS,
                                           stream=True))
    text = "".join(p.choices[0].delta.content or "" for p in parts)
    calls = [tc for p in parts for tc in p.choices[0].delta.tool_calls or ()]
    assert text == "Let me look." and [tc.function.name for tc in calls] == ["lookup"]
    assert parts[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice none: the call stays text; required and a named tool pass
    none = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS,
                                     tool_choice="none").choices[0]
    assert none.finish_reason == "stop" and "<tool_call>" in none.message.content
    for choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
        assert c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS,
                                         tool_choice=choice).choices[0].message.tool_calls
    # turn two, on the policy: the call and its result are in the prompt it sees
    turn2 = msgs + [{"role": "assistant", "content": ch.message.content,
                     "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    r2 = client(served["url"]).chat.completions.create(
        model="tiny", messages=turn2, tools=TOOLS, max_tokens=8,
        extra_body={"return_token_ids": True})
    seen = served["fmt"].decode(r2.prompt_token_ids)
    assert '"name": "lookup", "arguments": {"key": "k17"}' in seen
    assert "<tool_response>\n42\n</tool_response>" in seen
    assert r2.choices[0].finish_reason in ("stop", "length") and len(r2.choices[0].token_ids) <= 8


def test_n_choices_with_logprobs(served):
    r = ask(served["url"], n=3, max_tokens=6, logprobs=True, top_logprobs=2, seed=3)
    assert len(r.choices) == 3 and r.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in r.choices)
    for c in r.choices:
        assert 1 <= len(c.logprobs.content) <= 6
        for t in c.logprobs.content:
            assert math.isfinite(t.logprob) and t.logprob <= 0 and len(t.top_logprobs) == 2
    assert len({tuple(t.token for t in c.logprobs.content) for c in r.choices}) > 1


def test_completions_from_text_and_from_token_ids(served):
    c = client(served["url"])
    r = c.completions.create(model="tiny", prompt="the answer is", max_tokens=5,
                             temperature=0, extra_body={"return_token_ids": True})
    ids = r.prompt_token_ids
    assert ids == served["fmt"].encode("the answer is") and len(r.choices[0].token_ids) == 5
    again = c.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0,
                                 logprobs=1, extra_body={"return_token_ids": True})
    assert again.choices[0].text == r.choices[0].text
    assert again.choices[0].token_ids == r.choices[0].token_ids
    assert len(again.choices[0].logprobs.token_logprobs) == 5


def test_greedy_equals_the_samplers_own_generation(served):
    fmt, n = served["fmt"], 40
    r = ask(served["url"], "Count to ten", max_tokens=n, temperature=0, logprobs=True,
            extra_body={"return_token_ids": True})
    prompt = r.prompt_token_ids
    (own,) = generate(served["policy"], [prompt], n, stop_tokens=fmt.stop_ids)
    assert r.choices[0].token_ids == own.tokens
    assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(own.logprobs,
                                                                              abs=1e-4)
    assert r.choices[0].message.content == fmt.action_text(own.tokens)
    parts = list(ask(served["url"], "Count to ten", max_tokens=n, temperature=0, stream=True,
                     extra_body={"return_token_ids": True}))
    assert parts[0].prompt_token_ids == prompt
    assert [t for p in parts for c in p.choices for t in getattr(c, "token_ids", None) or ()
            ] == own.tokens
    assert "".join(c.delta.content or "" for p in parts for c in p.choices) == \
        r.choices[0].message.content
    # a stop string: the text ends before it, the ids at the token that completes it
    k = next(k for k in range(8, n - 2) if (lambda p: p.strip() and "\ufffd" not in p)(
        fmt.decode(own.tokens[k:k + 2])))
    stop = fmt.decode(own.tokens[k:k + 2])
    full = fmt.action_text(own.tokens)
    cut = next(j for j in range(1, n + 1) if stop in fmt.action_text(own.tokens[:j]))
    for stream in (False, True):
        got = ask(served["url"], "Count to ten", max_tokens=n, temperature=0, stop=[stop],
                  stream=stream, extra_body={"return_token_ids": True})
        if stream:
            got = list(got)
            text = "".join(c.delta.content or "" for p in got for c in p.choices)
            ids = [t for p in got for c in p.choices for t in getattr(c, "token_ids", None) or ()]
            finish = got[-1].choices[0].finish_reason
        else:
            text, ids = got.choices[0].message.content, got.choices[0].token_ids
            finish = got.choices[0].finish_reason
        assert (text, ids, finish) == (full[:full.find(stop)], own.tokens[:cut], "stop")
    done = client(served["url"]).completions.create(
        model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
        extra_body={"return_token_ids": True})
    assert [t for p in done for t in p.choices[0].token_ids] == own.tokens


BAD = [  # (body, status, param)
    (b'{"model": "tiny", "messages": [', 400, None),
    ({"model": "tiny"}, 400, "messages"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x " * 400}]}, 400, "messages"),
    ({"model": "tiny", "prompt": [5] * MAX_LEN}, 400, "prompt"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 17}, 400, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400,
     "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000},
     400, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 2.5},
     400, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400,
     "top_p"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
      "top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "retrieval"}]}, 400, "tools[0]"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     400, "tools[0].function.parameters"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff"}]}', 400, None),
    (b'{"model": "tiny", "pad": "' + b"x" * MAX_BODY_BYTES + b'"}', 413, None),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_input_is_a_4xx_naming_the_field(served, body, status, param):
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else \
        "/v1/chat/completions"
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(served["url"] + path, content=raw,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"], err
    assert ask(served["url"], max_tokens=2).choices[0].message is not None   # still serving


def test_a_prompt_too_long_says_the_limit_and_its_count(served):
    r = httpx.post(served["url"] + "/v1/completions",
                   json={"model": "tiny", "prompt": [5] * 300}, timeout=60)
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "300" in msg and str(MAX_LEN) in msg


def test_a_wrong_api_key_is_401(served):
    with pytest.raises(openai.AuthenticationError) as e:
        client(served["scripted"], "wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert client(served["scripted"], "secret").models.list().data[0].id == "tiny"


def test_sixteen_concurrent_sessions_complete(served):
    def session(i):
        r = ask(served["url"], f"session {i}", max_tokens=6 + i % 5, seed=i)
        return r.choices[0].finish_reason, r.usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        out = list(pool.map(session, range(16)))
    assert all(f in ("stop", "length") and 1 <= n <= 10 for f, n in out), out


def _wait_free(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while engine.free_rows < ROWS or engine.waiting:
        assert time.monotonic() < deadline, (engine.free_rows, len(engine.waiting))
        time.sleep(0.02)


def test_a_client_gone_mid_stream_frees_its_row(served):
    engine, slow = served["engine"], served["slow"]
    _wait_free(engine)
    cancelled = engine.cancelled
    slow.on = True
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "long"}],
                "max_tokens": 200, "stream": True, "ignore_eos": True}   # never ends first
        with httpx.stream("POST", served["url"] + "/v1/chat/completions", json=body,
                          timeout=60) as r:
            lines = r.iter_lines()
            assert next(l for l in lines if l.startswith("data:"))   # it runs
            assert next(l for l in lines if '"content"' in l and '""' not in l)
        assert engine.free_rows < ROWS or engine.cancelled > cancelled
        _wait_free(engine, timeout=3.0)     # 200 tokens would take 13 x 0.1 s
        assert engine.cancelled == cancelled + 1
    finally:
        slow.on = False


def _until(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_request_arriving_mid_decode_starts_at_once_and_settings_share_calls(served):
    """Two requests arrive while a long one decodes (submitted from its first event, on the
    engine's thread, so the moment is exact): both give their first tokens after the next
    decode call, and from then on the three, at temperatures 0.7, 0 and 1 with top_p 0.9,
    each with its own seed, advance in the same decode calls. The greedy one is still the
    sampler's own greedy generation."""
    engine, fmt = served["engine"], served["fmt"]
    _wait_free(engine)
    prompts = {k: fmt.encode(f"{k} request") for k in ("long", "greedy", "hot")}
    calls = {k: [] for k in prompts}        # (decode call, the event) per job
    arrived = []

    def record(k, then=None):
        def on_event(ev):
            calls[k].append((engine.decode_calls, ev))
            if then and len(calls[k]) == 1:
                then()
        return on_event

    def arrive():
        arrived.append(engine.decode_calls)
        engine.submit([job("greedy", 24, SamplingParams(0.0), (5, 0)),
                       job("hot", 24, SamplingParams(1.0, top_p=0.9), (6, 0))])

    def job(k, n, sp, stream, then=None):
        return Job(tuple(prompts[k]), n, sp, frozenset(), stream, record(k, then))

    engine.submit([job("long", 120, SamplingParams(0.7), (4, 0), then=arrive)])
    _until(lambda: all(c and c[-1][1].finish for c in calls.values()))
    at = {k: [n for n, ev in c if ev.tokens] for k, c in calls.items()}
    assert at["greedy"][0] - arrived[0] <= 2 and at["hot"][0] - arrived[0] <= 2
    assert at["greedy"] == at["hot"] and set(at["greedy"]) <= set(at["long"])
    assert at["long"][-1] > at["greedy"][-1]            # they ended while it decoded
    got = {k: [t for _, ev in c for t in ev.tokens] for k, c in calls.items()}
    assert [len(got[k]) for k in ("long", "greedy", "hot")] == [120, 24, 24]
    own = generate(served["policy"], [prompts["greedy"], prompts["hot"]], 24, stop_tokens=())
    assert got["greedy"] == own[0].tokens and got["hot"] != own[1].tokens   # hot: sampled


def test_the_next_turn_prefills_only_its_new_tokens(served):
    """A conversation's turns as token ids (prompt = the last prompt + its completion + the
    new message): each turn after the first keeps the row's cache and prefills only the new
    message, and still completes as a fresh greedy generation of the whole prompt does."""
    engine, fmt = served["engine"], served["fmt"]
    _wait_free(engine)
    c = client(served["url"])
    prompt, turns = fmt.encode("user: tell me a story\nassistant:"), []
    for turn in range(3):
        before = engine.prefilled, engine.reused
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                 extra_body={"return_token_ids": True})
        fresh = engine.prefilled - before[0], engine.reused - before[1]
        if turn:
            assert fresh == (len(new), len(prompt) - len(new)), (turn, fresh)
        turns.append((prompt, r.choices[0].token_ids))
        new = fmt.encode(f"\nuser: and then {turn}?\nassistant:")
        prompt = prompt + r.choices[0].token_ids + new
    own = generate(served["policy"], [p for p, _ in turns], 10, stop_tokens=fmt.stop_ids)
    assert [ids for _, ids in turns] == [g.tokens for g in own]


def test_a_storm_of_bad_requests_leaves_good_sessions_complete_and_correct(served):
    """Threads sending malformed bodies (every bad input above but the 4 MiB one, and
    random bytes) while six good two-turn sessions, three streamed, run: every bad request
    gets its 4xx, every good one completes as the sampler's own greedy generation."""
    engine, fmt = served["engine"], served["fmt"]
    _wait_free(engine)
    bad = [(b if isinstance(b, bytes) else json.dumps(b).encode(), st) for b, st, _ in BAD
           if st != 413]
    rs = __import__("random").Random(0)
    bad += [(bytes(rs.randrange(256) for _ in range(rs.randrange(1, 200))), 400)
            for _ in range(4)]
    stop, statuses = threading.Event(), []

    def storm(k):
        with httpx.Client(base_url=served["url"], timeout=60) as h:
            while not stop.is_set() or k < len(bad):     # each bad body at least once
                body, want = bad[k % len(bad)]
                r = h.post("/v1/chat/completions", content=body,
                           headers={"content-type": "application/json"})
                statuses.append((r.status_code, want, r.json()["error"]["type"]))
                k += 3

    def session(i):
        prompt, out = fmt.encode(f"session {i} asks:"), []
        for turn in range(2):
            kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                      extra_body={"return_token_ids": True})
            if i % 2:
                ids = [t for p in client(served["url"]).completions.create(stream=True, **kw)
                       for t in p.choices[0].token_ids]
            else:
                ids = client(served["url"]).completions.create(**kw).choices[0].token_ids
            out.append((list(prompt), ids))
            prompt = prompt + ids + fmt.encode(f"\nuser: turn {turn}\n")
        return out

    with ThreadPoolExecutor(9) as pool:
        storms = [pool.submit(storm, k) for k in range(3)]
        good = list(pool.map(session, range(6)))
        stop.set()
        for f in storms:
            f.result()
    assert len(statuses) >= len(bad) and all(400 <= s < 500 and s == want
                                             for s, want, _ in statuses), statuses
    turns = [t for s in good for t in s]
    own = generate(served["policy"], [p for p, _ in turns], 12, stop_tokens=fmt.stop_ids)
    assert [ids for _, ids in turns] == [g.tokens for g in own]
    assert httpx.get(served["url"] + "/health").json()["status"] == "ok"


def test_ignore_eos_samples_past_the_stop_tokens_to_max_tokens(served):
    """vLLM's `ignore_eos`: the same random streams as without it (same seed), but a choice
    that sampled a stop token goes on to max_tokens."""
    url, fmt = served["url"] + "/v1/chat/completions", served["fmt"]
    for seed in range(7, 12):       # a seed whose 16 choices sample a stop token (most do)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "eos"}], "n": 16,
                "max_tokens": 48, "seed": seed, "return_token_ids": True}
        plain = httpx.post(url, json=body, timeout=60).json()["choices"]
        stopped = [c for c in plain if c["finish_reason"] == "stop"]
        if stopped:
            break
    assert stopped and all(c["token_ids"][-1] in fmt.stop_ids for c in stopped)
    ignored = httpx.post(url, json=dict(body, ignore_eos=True), timeout=60).json()["choices"]
    for a, b in zip(plain, ignored):
        assert b["finish_reason"] == "length" and len(b["token_ids"]) == 48
        assert b["token_ids"][:len(a["token_ids"])] == a["token_ids"]
        # the text leaves the stop tokens out, wherever they were sampled
        assert b["message"]["content"] == fmt.decode(
            [t for t in b["token_ids"] if t not in fmt.stop_ids])
    assert httpx.post(url, json=dict(body, ignore_eos="yes"), timeout=60).status_code == 400
    # as the openai SDK sends it (extra_body), and the server answers after the 400
    r = ask(served["url"], "eos", max_tokens=8, seed=seed, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8


def test_a_full_queue_is_429_with_retry_after(served):
    """With every row busy and the queue full (20 jobs submitted to the engine itself, no
    stop ids, each 100 tokens at 1 s a decode call: none ends for seconds), a request is
    refused with 429, Retry-After and a rate_limit_error; once they are cancelled, served.
    (A streamed HTTP request held open with `next(r.iter_lines())` closes itself when the
    dropped line iterator is collected: its jobs were cancelled, and on a loaded machine
    dropped before the second request came, which CI saw admitted.)"""
    engine, slow, fmt = served["engine"], served["slow"], served["fmt"]
    _wait_free(engine)
    slow.on, slow.delay = True, 1.0
    busy = [Job(tuple(fmt.encode("busy")), 100, SamplingParams(1.0), frozenset(), (9, i),
                lambda ev: None) for i in range(ROWS + QUEUE)]
    try:
        engine.submit(busy)
        _until(lambda: engine.free_rows == 0, timeout=10)
        assert len(engine.waiting) == QUEUE, (engine.free_rows, len(engine.waiting))
        body = {"model": "tiny", "messages": [{"role": "user", "content": "busy"}],
                "max_tokens": 4}
        full = httpx.post(served["url"] + "/v1/chat/completions", json=body, timeout=60)
        assert full.status_code == 429 and full.headers["retry-after"] == "1", full.text
        assert full.json()["error"]["type"] == "rate_limit_error"
    finally:
        for job in busy:
            job.cancel()
        slow.on, slow.delay = False, 0.1
    _wait_free(engine)
    assert ask(served["url"], max_tokens=2, n=5).choices[4].message is not None


def test_the_command_serves_until_sigterm_and_finishes_the_request_in_flight(served,
                                                                             tmp_path):
    served["policy"].save_pretrained(str(tmp_path / "pol"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "supo_jax.cli", "serve", "--policy", str(tmp_path / "pol"),
         "--port", "0", "--rows", "2", "--max-len", "128", "--served-model-name", "pol"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = re.fullmatch(r"serving pol on (http://127\.0\.0\.1:\d+)/v1 .*\n", line)
        assert url, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = url.group(1)
        assert httpx.get(url + "/health").json()["free_rows"] == 2
        body = {"model": "pol", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 60, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")    # in flight: the role chunk came
            proc.send_signal(signal.SIGTERM)
            rest = [l for l in lines if l]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 60
        assert proc.wait(30) == 0
    finally:
        proc.kill()


def test_stream_holds_back_a_partial_stop_string():
    assert api.stop_hold("abc</st", ("</stop>",)) == 4
    assert api.stop_hold("abc", ("</stop>",)) == 0
    assert api.call_start("Sure. <tool_", ("hermes",)) == len("Sure.")
    assert api.call_start("Sure.", ("hermes",)) == 5
