"""Token in / token out: a segment's tokens equal the chat template's rendering."""
import dataclasses

import pytest

from supo_jax.agent import context as C
from supo_jax.agent.render import ChatFormat
from supo_jax.model.tiny import tiny_tokenizer
from tests.helpers import llama3_style_tokenizer

TOOLS = [{"type": "function", "function": {"name": "look", "description": "look at item i",
          "parameters": {"type": "object", "properties": {"i": {"type": "integer"}},
                         "required": ["i"]}}}]


@pytest.fixture(scope="module", params=["qwen_style", "compact", "llama3_style"])
def fmt(request):
    tok = (tiny_tokenizer() if request.param == "qwen_style" else
           tiny_tokenizer(template="compact") if request.param == "compact" else
           llama3_style_tokenizer())
    return ChatFormat(tok)


def _act(fmt, text, stop=True):
    ids = fmt.encode(text) + ([fmt.stop_id] if stop else [])
    return C.Turn(tuple(ids), tuple([-0.5] * len(ids)), text)


def _template_ids(fmt, messages, gen=False):
    return fmt.encode(fmt.tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                        add_generation_prompt=gen))


def test_segment_tokens_equal_template_rendering(fmt):
    cfg = C.ContextConfig(working_context=10_000)
    msgs = [{"role": "user", "content": "Count the items."}]
    st = C.initial_state(fmt, msgs, TOOLS)
    assert list(st.tokens) == _template_ids(fmt, msgs)
    assert list(C.request_tokens(fmt, st)) == _template_ids(fmt, msgs, gen=True)
    convo = list(msgs)
    for i, stop in enumerate([True, True, False]):   # the last action hit its token budget
        a = f'looking <tool_call>\n{{"name": "look", "arguments": {{"i": {i}}}}}\n</tool_call>'
        st = C.after_action(cfg, fmt, st, _act(fmt, a, stop), f"item {i} is red", False)
        convo += [{"role": "assistant", "content": a}, {"role": "tool", "content": f"item {i} is red"}]
        assert list(st.tokens) == _template_ids(fmt, convo)
        # the mask marks exactly the sampled tokens
        assert sum(st.mask) == sum(len(fmt.encode(m["content"])) + 1 for m in convo
                                   if m["role"] == "assistant") - (0 if stop else 1)
    st = C.after_action(cfg, fmt, st, _act(fmt, "done"), None, True, 1.0)
    convo.append({"role": "assistant", "content": "done"})
    seg = st.segments[-1]
    assert st.reason == "answer" and st.reward == 1.0
    assert list(seg.tokens) == _template_ids(fmt, convo)[:len(seg.tokens)]
    assert seg.tokens[-1] == fmt.stop_id


def test_summary_segment_and_restart_render_like_template(fmt):
    msgs = [{"role": "user", "content": "Count the items."}]
    st = C.initial_state(fmt, msgs, TOOLS)
    cfg = C.ContextConfig(trigger_ratio=1.0, max_summaries=2, max_summary_tokens=16,
                          trigger_rule="reserve")
    cfg = dataclasses.replace(cfg, working_context=len(st.tokens) + 60 + cfg.reserve(fmt))
    convo = list(msgs)
    i = 0
    while st.phase == "act":
        a = f'<tool_call>\n{{"name": "look", "arguments": {{"i": {i}}}}}\n</tool_call>'
        prev = st
        st = C.after_action(cfg, fmt, st, _act(fmt, a), f"item {i} is red", False)
        if st.phase == "act":
            convo += [{"role": "assistant", "content": a}, {"role": "tool", "content": f"item {i} is red"}]
            assert st.context_len < cfg.trigger
        i += 1
    assert st.phase == "summarize"
    # the overflowing pair is dropped: the summary request is the old context + instruction
    want = convo + [{"role": cfg.summary_role, "content": cfg.summary_instruction}]
    assert list(C.request_tokens(fmt, st)) == _template_ids(fmt, want, gen=True)
    assert st.tokens == prev.tokens
    summary = "<summary>\nlooked at items 0-3\n</summary>"
    st = C.after_summary(cfg, fmt, st, _act(fmt, summary))
    seg = st.segments[-1]
    assert list(seg.tokens) == _template_ids(fmt, want + [{"role": "assistant", "content": summary}])[:len(seg.tokens)]
    assert seg.mask[-1] == 1 and st.summaries == 1 and st.summary_lengths[-1] == len(fmt.encode(summary)) + 1
    # restart: s1 + continuation (a user turn holding the summary)
    cont = cfg.continuation.format(prompt=msgs[0]["content"], summary="looked at items 0-3")
    assert list(st.tokens) == _template_ids(fmt, msgs + [{"role": "user", "content": cont}])
    assert st.tokens[:len(st.prefix)] == st.prefix and not any(st.mask)


def test_summarizer_can_see_dropped_pair(fmt):
    msgs = [{"role": "user", "content": "Go."}]
    st = C.initial_state(fmt, msgs, TOOLS)
    cfg = C.ContextConfig(trigger_ratio=1.0, trigger_rule="reserve", show_dropped_to_summarizer=True, max_action_tokens=100,
                          max_observation_tokens=60, max_summary_tokens=20)
    cfg = dataclasses.replace(cfg, working_context=len(st.tokens) + 30 + cfg.reserve(fmt))
    a = '<tool_call>\n{"name": "look", "arguments": {"i": 1}}\n</tool_call>'
    while st.phase == "act":
        st = C.after_action(cfg, fmt, st, _act(fmt, a), "x" * 20, False)
    assert st.phase == "summarize"
    assert len(st.tokens) >= cfg.limit(fmt)  # the overflowing pair is kept for the summarizer
    assert st.pending[:len(st.tokens)] == st.tokens
    # the summary request + a full summary fit W
    assert len(st.pending) + len(fmt.gen_prompt) + cfg.max_summary_tokens <= cfg.working_context


def test_a_template_that_drops_tools_is_noticed(fmt, capsys):
    """SmolLM2's template ignores `tools`: every command says so at start (check_prompt_fits)
    instead of running a policy that was never told the tools."""
    from supo_jax.config import load_config
    from supo_jax.rl.runs import check_prompt_fits
    assert fmt.renders_tools
    cfg = load_config(None, ["context.working_context=4096"])
    check_prompt_fits(cfg, fmt)
    assert "does not render the tools" not in capsys.readouterr().out
    tok = tiny_tokenizer()
    tok.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + "
                         "m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
                         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    bare = ChatFormat(tok)
    assert not bare.renders_tools
    check_prompt_fits(cfg, bare)
    assert "does not render the tools" in capsys.readouterr().out
