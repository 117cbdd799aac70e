"""Tool-call parser: valid calls, every error kind, hard limits, summaries, canonical format."""
import json
import sys
import time

import pytest

from supo_jax.text.parsing import (CALL_FORMATS, MAX_ACTION_CHARS, QUOTE_CHARS,
                                    extract_summary, format_tool_call, parse_action)

ALL = CALL_FORMATS

TOOLS = {
    "compare": {"type": "object", "required": ["i", "j"],
                "properties": {"i": {"type": "integer"}, "j": {"type": "integer"}}},
    "search": {"type": "object", "required": ["query"],
               "properties": {"query": {"type": "string"}, "k": {"type": "integer"},
                              "w": {"type": "number"}, "exact": {"type": "boolean"},
                              "tags": {"type": "array", "items": {"type": "string"}},
                              "opts": {"type": "object"},
                              "mode": {"type": "string", "enum": ["bm25", "dense"]}}},
    "finish": {"type": "object", "required": ["answer"],
               "properties": {"answer": {"type": "integer"}}},
}


def call(name, args):
    return format_tool_call(name, args)


def err(text, **kw):
    p = parse_action(text, TOOLS, **kw)
    assert p.kind == "error" and p.name is None and p.arguments is None, p
    return p.error


def test_valid_call_with_thought_and_whitespace():
    p = parse_action('I compare.\n<tool_call>  \n\t{"name": "compare", "arguments": '
                     '{"i": 1, "j": 2}}\n\n</tool_call> trailing', TOOLS)
    assert (p.kind, p.name, p.arguments, p.error) == ("call", "compare", {"i": 1, "j": 2}, None)
    assert p.calls == (("compare", {"i": 1, "j": 2}),)


def test_answer_tool_gives_answer_kind():
    p = parse_action(call("finish", {"answer": 3}), TOOLS)
    assert (p.kind, p.name, p.arguments) == ("answer", "finish", {"answer": 3})
    assert parse_action(call("compare", {"i": 0, "j": 1}), TOOLS, answer_tool="compare").kind \
        == "answer"


def test_optional_and_typed_arguments():
    args = {"query": "x", "k": 3, "w": 0.5, "exact": True, "tags": ["a"], "opts": {"z": 1},
            "mode": "dense"}
    assert parse_action(call("search", args), TOOLS).arguments == args
    assert parse_action(call("search", {"query": "x", "w": 2}), TOOLS).kind == "call"  # int ok
    # "arguments" may be left out when nothing is required
    free = {"ping": {"type": "object", "properties": {}}}
    assert parse_action('<tool_call>{"name": "ping"}</tool_call>', free).arguments == {}


@pytest.mark.parametrize("text, needle", [
    ("just thinking, no call", "no tool call"),
    ("<tool_call>{\"name\": \"compare\"", "unterminated"),
    ("</tool_call>", "without an opening"),
    ("<tool_call><tool_call>{}</tool_call></tool_call>", "nested"),
    ("<tool_call>{'name': 'compare'}</tool_call>", "malformed JSON"),
    ('<tool_call>{"name": "compare", "arguments": {"i": 1,}}</tool_call>', "malformed JSON"),
    ("<tool_call>{\"name\": \"finish\", \"arguments\": {\"answer\": NaN}}</tool_call>",
     "malformed JSON"),
    ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
    ("<tool_call>\"compare\"</tool_call>", "must be a JSON object"),
    ("<tool_call>{\"arguments\": {}}</tool_call>", 'no "name"'),
    ("<tool_call>{\"name\": 7, \"arguments\": {}}</tool_call>", '"name" must be a string'),
    ("<tool_call>{\"name\": \"compare\", \"arguments\": [1, 2]}</tool_call>",
     "must be a JSON object"),
    ("<tool_call>{\"name\": \"compare\", \"arguments\": \"{\\\"i\\\": 1}\"}</tool_call>",
     "must be a JSON object"),
])
def test_structural_errors(text, needle):
    assert needle in err(text)


def test_unknown_tool_lists_valid_names():
    e = err(call("rm_rf", {}))
    assert "unknown tool" in e and "compare, finish, search" in e


@pytest.mark.parametrize("name, args, needle", [
    ("compare", {"i": 1}, 'missing required argument "j"'),
    ("compare", {"i": 1, "j": 2, "k": 3}, 'unexpected argument "k"'),
    ("compare", {"i": "1", "j": 2}, "expected integer, got string"),
    ("compare", {"i": 1.0, "j": 2}, "expected integer, got number"),
    ("compare", {"i": True, "j": 2}, "expected integer, got boolean"),  # bool is not an int
    ("compare", {"i": None, "j": 2}, "expected integer, got null"),
    ("search", {"query": 5}, "expected string, got integer"),
    ("search", {"query": "q", "w": False}, "expected number, got boolean"),
    ("search", {"query": "q", "exact": 1}, "expected boolean, got integer"),
    ("search", {"query": "q", "tags": "a"}, "expected array, got string"),
    ("search", {"query": "q", "tags": ["a", 1]}, 'argument "tags"[1]'),
    ("search", {"query": "q", "opts": []}, "expected object, got array"),
    ("search", {"query": "q", "mode": "grep"}, "expected one of"),
])
def test_argument_errors(name, args, needle):
    assert needle in err(call(name, args))


def test_max_calls():
    two = call("compare", {"i": 0, "j": 1}) + call("compare", {"i": 1, "j": 2})
    assert "too many tool calls (2)" in err(two)
    p = parse_action(two + call("finish", {"answer": 2}), TOOLS, max_calls=3)
    assert p.kind == "answer" and [n for n, _ in p.calls] == ["compare", "compare", "finish"]
    assert "must be the last call" in err(call("finish", {"answer": 1}) + two, max_calls=3)


def test_limits_are_fast_and_quotes_are_short():
    t0 = time.perf_counter()
    assert "too long" in err("x" * (MAX_ACTION_CHARS + 1))
    assert "too long" in err("<tool_call>" * 200_000)
    deep = '<tool_call>{"name": "compare", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    assert "deeper than" in err(deep + "</tool_call>")
    deep_obj = "<tool_call>" + '{"a":' * 3000 + "1" + "}" * 3000 + "</tool_call>"
    assert "deeper than" in err(deep_obj)
    assert "deeper than" in err(call("compare", {"i": json.loads("[" * 40 + "]" * 40), "j": 1}))
    opts = json.loads('{"a":' * 30 + "1" + "}" * 30)  # 32 levels with the call and arguments
    assert parse_action(call("search", {"query": "q", "opts": opts}), TOOLS).kind == "call"
    # no quadratic scans: thousands of escaped quotes and an unterminated string
    for body in ['"' + '\\"' * 9000 + "[" * 40, '{"name": "' + '\\"' * 9000 + "[" * 40,
                 '"' * 19000 + "[" * 40]:
        assert "malformed JSON" in err(f"<tool_call>{body}</tool_call>")
    # deep and broken further on: one verdict, however deep the caller's stack (the
    # decoder's RecursionError comes sooner from a deeper stack)
    broken = ('<tool_call>{"name": "compare", "arguments": {"i": ' + "[" * 500 + "1"
              + "]" * 499 + "</tool_call>")

    def nested(n):
        return err(broken) if n == 0 else nested(n - 1)
    assert "deeper than" in err(broken) and nested(sys.getrecursionlimit() - 150) == err(broken)
    # brackets inside strings do not count as nesting
    p = parse_action(call("search", {"query": "[" * 500 + "{" * 500}), TOOLS)
    assert p.kind == "call"
    assert "malformed JSON" in err("<tool_call>{\"name\": \"finish\", \"arguments\": "
                                   "{\"answer\": " + "9" * 5000 + "}}</tool_call>")
    long_name = "n" * 5000
    for e in (err(call(long_name, {})), err(call("compare", {long_name: 1, "i": 1, "j": 1}))):
        assert len(e) < QUOTE_CHARS + 120
    assert time.perf_counter() - t0 < 1.0


def test_quotes_are_valid_utf8():
    e = err('<tool_call>{"name": "\\ud800\\udfff\\ud800x", "arguments": {}}</tool_call>')
    e.encode("utf-8")  # no lone surrogates left
    assert err(None) == "the action is not text"


def test_extract_summary():
    assert extract_summary("blah <summary>\n best=3; next=4 \n</summary> tail") == "best=3; next=4"
    assert extract_summary("<summary>old</summary> <summary>new</summary>") == "new"
    assert extract_summary("<summary>a <summary>b</summary>") == "b"
    assert extract_summary("<summary>unterminated") is None
    assert extract_summary("none") is None
    assert extract_summary("</summary><summary>") is None
    assert extract_summary("<summary></summary>") == ""


def test_format_tool_call_is_canonical_and_round_trips():
    args = {"query": 'héllo "q"', "k": 2}
    text = format_tool_call("search", args)
    assert text == ('<tool_call>\n{"name": "search", "arguments": {"query": "héllo \\"q\\"", '
                    '"k": 2}}\n</tool_call>')
    p = parse_action(text, TOOLS)
    assert (p.kind, p.name, p.arguments) == ("call", "search", args)
    assert json.loads(text.split("\n")[1]) == {"name": "search", "arguments": args}


def err_all(text, **kw):
    return err(text, formats=ALL, **kw)


def test_native_formats_of_other_chat_templates():
    """Without a <tool_call> tag, the call forms Llama 3.x's and Mistral's chat templates ask
    for are read where `formats` names them (validated as strictly as Hermes calls), and are
    no call otherwise (a tiny policy's actions read as they always have)."""
    llama = '{"name": "compare", "parameters": {"i": 1, "j": 2}}'
    mistral = '[TOOL_CALLS] [{"name": "compare", "arguments": {"i": 3, "j": 4}}]'
    seed = ("<seed:tool_call><function=compare><parameter=i>1</parameter><parameter=j>2"
            "</parameter></function></seed:tool_call>")
    for text in (llama, mistral, seed):
        assert "no tool call found" in err(text), text
    assert "malformed JSON" in err("<tool_call><function=compare></function></tool_call>")
    for text in (llama, f"  {llama}\n", f"<|python_tag|>{llama}"):
        p = parse_action(text, TOOLS, formats=("hermes", "llama3_json"))
        assert (p.kind, p.name, p.arguments) == ("call", "compare", {"i": 1, "j": 2}), text
    assert "no tool call found" in err(llama, formats=("hermes", "mistral"))
    p = parse_action('{"name": "finish", "parameters": {"answer": 4}}', TOOLS, formats=ALL)
    assert (p.kind, p.arguments) == ("answer", {"answer": 4})
    for text in (mistral, '[TOOL_CALLS]{"name": "compare", "arguments": {"i": 3, "j": 4}}'):
        p = parse_action(text, TOOLS, formats=("hermes", "mistral"))
        assert (p.kind, p.name, p.arguments) == ("call", "compare", {"i": 3, "j": 4}), text
    two = '[TOOL_CALLS] [{"name": "compare", "arguments": {"i": 0, "j": 1}}, ' \
          '{"name": "finish", "arguments": {"answer": 1}}]'
    assert "too many tool calls (2)" in err_all(two)
    assert parse_action(two, TOOLS, max_calls=2, formats=ALL).kind == "answer"
    # the same checks as a Hermes call: schema, names, JSON, nesting
    assert "wrong type" in err_all('{"name": "compare", "parameters": {"i": "1", "j": 2}}')
    assert "unknown tool" in err_all('[TOOL_CALLS] [{"name": "rm", "arguments": {}}]')
    assert "malformed JSON" in err_all('[TOOL_CALLS] [{"name": "compare", "arguments": {"i": 1')
    assert "deeper than" in err_all("[TOOL_CALLS] " + "[" * 5000 + "]" * 5000)
    assert "must be a JSON object" in err_all("[TOOL_CALLS] [3]")
    # prose around a bare object, an object without a name, or plain JSON is no call
    for text in ('I call {"name": "compare", "parameters": {"i": 1, "j": 2}}',
                 '{"i": 1, "j": 2}', '{"name": "compare", "parameters": {"i": 1, "j": 2}',
                 "[1, 2]"):
        assert "no tool call found" in err_all(text), text
    # a Hermes tag wins: its body is what is parsed
    p = parse_action('<tool_call>{"name": "compare", "arguments": {"i": 5, "j": 6}}</tool_call>'
                     ' [TOOL_CALLS] [{"name": "rm"}]', TOOLS, formats=ALL)
    assert p.arguments == {"i": 5, "j": 6}


def test_function_parameter_calls_of_seed_oss_and_qwen3_coder():
    """<function=...><parameter=...> bodies (Seed-OSS's <seed:tool_call>, Qwen3-Coder's
    <tool_call>) under the seed_oss format: values typed by the tool's schema, then
    validated like any call."""
    seed = ("<seed:think>read card 2</seed:think><seed:tool_call>\n<function=compare>\n"
            "<parameter=i>\n2\n</parameter>\n<parameter=j>7</parameter>\n</function>\n"
            "</seed:tool_call>")
    p = parse_action(seed, TOOLS, formats=("hermes", "seed_oss"))
    assert (p.kind, p.name, p.arguments) == ("call", "compare", {"i": 2, "j": 7})
    coder = ("<tool_call>\n<function=search>\n<parameter=query>\n3 < 4 and {x}\n</parameter>\n"
             "<parameter=tags>[\"a\", \"b\"]</parameter>\n<parameter=exact>true</parameter>\n"
             "</function>\n</tool_call>")
    p = parse_action(coder, TOOLS, formats=("hermes", "seed_oss"))
    assert p.arguments == {"query": "3 < 4 and {x}", "tags": ["a", "b"], "exact": True}
    p = parse_action("<seed:tool_call><function=finish><parameter=answer>5</parameter>"
                     "</function></seed:tool_call>", TOOLS, formats=ALL)
    assert (p.kind, p.arguments) == ("answer", {"answer": 5})
    assert "wrong type" in err_all("<seed:tool_call><function=compare><parameter=i>two</parameter>"
                               "<parameter=j>1</parameter></function></seed:tool_call>")
    assert "missing required argument" in err_all(
        "<seed:tool_call><function=compare><parameter=i>1</parameter></function></seed:tool_call>")
    assert "unknown tool" in err_all("<seed:tool_call><function=rm></function></seed:tool_call>")
    assert "unterminated <function" in err_all("<seed:tool_call><function=compare></seed:tool_call>")
    assert "unterminated <parameter" in err_all(
        "<tool_call><function=compare><parameter=i>1</function></tool_call>")
    # hostile: many unterminated parameters stay linear-time
    t0 = time.perf_counter()
    big = "<tool_call><function=search>" + "<parameter=q>" * 1500 + "</function></tool_call>"
    assert "unterminated <parameter" in err_all(big)
    assert time.perf_counter() - t0 < 0.5


def test_parameters_key_only_under_llama3_json():
    """A Hermes call keeps reading "arguments" only (a tiny policy that writes "parameters"
    gets the error it always got); llama3_json reads "parameters"."""
    text = '<tool_call>{"name": "compare", "parameters": {"i": 1, "j": 2}}</tool_call>'
    assert "missing required argument" in err(text)
    assert parse_action(text, TOOLS, formats=("hermes", "llama3_json")).arguments == {"i": 1, "j": 2}
