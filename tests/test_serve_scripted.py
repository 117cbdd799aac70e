"""`supo-jax serve --policy scripted`: an environment's scripted expert behind the endpoint
(supo_jax.serve.scripted), read from ChatML prompts; tests/test_bfcl_runner.py drives it with
BFCL's own runner."""
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from supo_jax.agent.render import ChatFormat
from supo_jax.model.tiny import tiny_tokenizer
from supo_jax.serve.app import Running, Server, build_app
from supo_jax.serve.scripted import ScriptedEngine, chatml_messages

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "the value of a key",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                   "required": ["key"]}}}]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k17"}}\n</tool_call>'


class Recorder:
    """An expert that records the messages it is given: a call first, then a reply."""

    def __init__(self):
        self.seen = []

    def act(self, messages, summarize=False):
        self.seen.append(messages)
        return "k17 is 4." if messages[-1]["role"] == "tool" else CALL


def test_chatml_prompts_read_back_into_messages():
    tok = tiny_tokenizer()
    fmt = ChatFormat(tok)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"},
                {"role": "assistant", "content": CALL}, {"role": "tool", "content": "4"},
                {"role": "tool", "content": "five\nlines"}]
    text = fmt.decode(fmt.encode(tok.apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=True)))
    assert chatml_messages(text) == messages
    # a reasoning block heading an assistant turn is not the reply; a generation prompt
    # that opens one is still the generation prompt
    think = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\n"
    assert chatml_messages(think) == [{"role": "user", "content": "Q"}]
    assert chatml_messages(think + "A<|im_end|>\n")[-1] == {"role": "assistant", "content": "A"}
    with pytest.raises(ValueError, match="ChatML"):
        chatml_messages("User: hi\nAssistant:")


@pytest.fixture
def scripted():
    tok = tiny_tokenizer()
    fmt = ChatFormat(tok)
    expert = Recorder()
    engine = ScriptedEngine(expert, fmt, 4096, rows=2)
    running = Running(build_app(Server(engine, fmt, "scripted")))
    yield running.url, expert, engine
    running.stop()
    engine.close()


def test_the_expert_answers_chats_with_tool_calls_and_token_ids(scripted):
    """Over the official SDK: the expert sees the client's messages as sent (tool results
    included), its call comes back parsed as tool_calls, its ids and log-probabilities (0: a
    deterministic policy) with them; then its reply ends the turn."""
    url, expert, _ = scripted
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "What is k17?"}]
    r = client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS,
                                       logprobs=True, extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "lookup"
    assert c.message.tool_calls[0].function.arguments == '{"key": "k17"}'
    assert all(x.logprob == 0.0 for x in c.logprobs.content)
    assert expert.seen[-1][-1] == messages[-1] and expert.seen[-1][0]["role"] == "system"
    messages += [c.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": "4"}]
    r = client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
    assert r.choices[0].message.content == "k17 is 4." and r.choices[0].finish_reason == "stop"
    assert expert.seen[-1][-1] == {"role": "tool", "content": "4"}


def test_what_the_expert_cannot_read_fails_that_request_alone(scripted):
    """A prompt that is not ChatML (a raw completion) is a 500 naming it, top_logprobs a 400
    (no distribution to rank); the next request is answered."""
    url, _, engine = scripted
    with httpx.Client(base_url=url) as h:
        r = h.post("/v1/completions", json={"model": "scripted", "prompt": "User: hi"})
        assert r.status_code == 500 and "ChatML" in r.json()["error"]["message"]
        r = h.post("/v1/chat/completions", json={
            "model": "scripted", "messages": [{"role": "user", "content": "k17?"}],
            "logprobs": True, "top_logprobs": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        r = h.post("/v1/chat/completions", json={
            "model": "scripted", "messages": [{"role": "user", "content": "k17?"}]})
        assert r.status_code == 200 and engine.failed == 1


def test_the_command_serves_an_environments_expert(tmp_path):
    """`supo-jax serve --policy scripted --env fncall/tallest --tokenizer DIR`: its ready line,
    then the expert's answer to the environment's own first prompt; without --env, one line."""
    from supo_jax.envs import make_env, make_tasks
    from supo_jax.envs.experts import expert_for

    tok = tiny_tokenizer(out_dir=str(tmp_path / "tok"))
    cmd = [sys.executable, "-m", "supo_jax.cli", "serve", "--policy", "scripted"]
    r = subprocess.run(cmd + ["--tokenizer", str(tmp_path / "tok")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "--policy scripted needs --env" in r.stderr.splitlines()[-1]
    p = subprocess.Popen(cmd + ["--env", "fncall/tallest", "--tokenizer", str(tmp_path / "tok"),
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        line = p.stdout.readline()
        url = re.match(r"serving scripted on (http://127\.0\.0\.1:\d+)/v1 \(the scripted "
                       r"expert of fncall/tallest", line).group(1)
        task = make_tasks("fncall/tallest", "eval", 1, seed=0)[0]
        first = make_env("fncall/tallest").reset(task)
        messages = [{"role": "user", "content": first.prompt}]
        want = expert_for("fncall/tallest").act(chatml_messages(tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)))
        assert want.startswith("<tool_call>") or "\n<tool_call>" in want, want
        body = {"model": "scripted", "messages": messages, "return_token_ids": True}
        got = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        ids = got["choices"][0]["token_ids"]
        assert ChatFormat(tok).action_text(ids) == want
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
