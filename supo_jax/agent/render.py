"""Chat rendering, token in / token out.

The policy's sampled tokens are never re-tokenized. Everything else that enters
the context (the initial prompt, tool observations, the summary instruction,
the continuation after a summary) is rendered with the tokenizer's own chat
template and tokenized as a *delta*: the template text a turn adds after the
previous turn, measured once per (previous role, role) on placeholder content.
So a segment's token sequence equals what the template renders for the same
conversation (whenever the sampled tokens are the canonical tokenization of
their text; tests check this).

A working context is kept *closed*: it ends where a turn ends, and the
generation prompt (e.g. "<|im_start|>assistant\\n") is added only when the
policy is asked to act. After an assistant turn the delta starts with the
turn's closing text, minus the sampled stop token when the action ended with one.
"""
from __future__ import annotations

import functools

_A = "\x00A\x00"
_T = "\x00T\x00"
_BASES = {
    "user": [{"role": "user", "content": "U"}],
    "assistant": [{"role": "user", "content": "U"}, {"role": "assistant", "content": _A}],
    "tool": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"},
             {"role": "tool", "content": "T"}],
}


class ChatFormat:
    """Template pieces of one tokenizer. `stop_ids`: tokens that end an assistant turn."""

    def __init__(self, tokenizer, extra_stop_tokens=()):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        # the end-of-turn token is whatever special token the template closes an assistant turn with
        base = self._render(_BASES["assistant"])
        closing = base[base.index(_A) + len(_A):]
        specials = sorted((t for t in tokenizer.all_special_tokens + list(tokenizer.get_added_vocab())
                           if t and closing.startswith(t)), key=len, reverse=True)
        stops = set(extra_stop_tokens) | set(specials[:1])
        if tokenizer.eos_token:
            stops.add(tokenizer.eos_token)
        if not specials:
            raise ValueError("chat template closes assistant turns without a special token: "
                             f"cannot tell when the policy ends a turn ({closing[:40]!r})")
        self.stop_text = tuple(sorted(stops, key=len, reverse=True))
        self.stop_ids = frozenset(vocab[t] for t in stops)
        self.stop_id = vocab[specials[0]]
        closed = self._render(_BASES["tool"], False)
        opened = self._render(_BASES["tool"], True)
        if not opened.startswith(closed):
            raise ValueError("chat template's generation prompt is not an append-only suffix")
        self.gen_prompt = self.encode(opened[len(closed):])

    _PROBE = [{"type": "function", "function": {
        "name": "supo_probe_tool", "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template puts `tools` into the prompt (SmolLM2's, for one, drops
        them: its policy is told of the tools only by what the task prompt says)."""
        try:
            return "supo_probe_tool" in self._render([{"role": "user", "content": "U"}],
                                                     tools=self._PROBE)
        except Exception:   # noqa: BLE001  (a template that rejects tools renders none)
            return False

    @functools.cached_property
    def call_formats(self) -> tuple[str, ...]:
        """The tool-call forms an action is read in (supo_jax.text.parsing.CALL_FORMATS):
        Hermes always, and the form this chat template writes an assistant's tool call in
        (Seed-OSS tags, Mistral's [TOOL_CALLS], Llama 3.x's bare JSON with "parameters"), as
        rendered on a probe call."""
        call = {"role": "assistant", "content": "", "tool_calls": [{
            "id": "abcdefghi", "type": "function",   # Mistral's templates want 9-character ids
            "function": {"name": "supo_probe_tool", "arguments": {"x": 1}}}]}
        user = [{"role": "user", "content": "U"}]
        try:   # the assistant turn alone: what the template adds after the user turn
            base = self._render(user, tools=self._PROBE)
            text = self._render(user + [call], tools=self._PROBE)
        except Exception:   # noqa: BLE001  (a template without tool calls: Hermes only)
            return ("hermes",)
        text = text[len(base):] if text.startswith(base) else ""
        found = ["hermes"]
        if "<seed:tool_call>" in text or "<function=supo_probe_tool>" in text:
            found.append("seed_oss")
        if '"parameters"' in text and "<tool_call>" not in text:
            found.append("llama3_json")
        if "[TOOL_CALLS]" in text:
            found.append("mistral")
        return tuple(found)

    def _render(self, messages, gen=False, tools=None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=gen)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def action_text(self, ids) -> str:
        """Text of a sampled action without its trailing stop token (what parsers read)."""
        ids = list(ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.decode(ids)

    @functools.lru_cache(maxsize=None)
    def _pieces(self, prev: str, role: str) -> tuple[str, str]:
        base = _BASES[prev]
        try:
            full = self._render(base + [{"role": role, "content": _T}])
        except Exception as e:   # noqa: BLE001  (jinja's errors: a template that refuses the turn)
            raise ValueError(f"the chat template cannot render a {role} turn after a {prev} turn "
                             f"({type(e).__name__}: {e}); a summary instruction can be a user "
                             "turn instead: context.summary_role=user") from None
        if prev == "assistant":
            start = self._render(base).index(_A) + len(_A)
        else:
            start = len(self._render(base))
            if not full.startswith(self._render(base)):
                raise ValueError("chat template does not render turns append-only")
        d = full[start:]
        i = d.index(_T)
        return d[:i], d[i + len(_T):]

    @functools.lru_cache(maxsize=None)
    def instruction_len(self, text: str, role: str = "user") -> int:
        """Tokens of a `role` turn holding `text` after a user or a tool turn (the longer)."""
        return max(len(self.turn(prev, role, text)) for prev in ("user", "tool"))

    def prompt(self, messages: list[dict], tools=None) -> list[int]:
        """Tokens of the initial prompt s1 (system + tools + user task), closed."""
        return self.encode(self._render(messages, False, tools))

    def turn(self, prev: str, role: str, text: str, action_ids=()) -> list[int]:
        """Tokens of a `role` turn holding `text` after a `prev` turn ('user'|'assistant'|'tool').

        After an assistant turn, pass the action's ids: if they end with a stop
        token, the closing text it already produced is not repeated.
        """
        before, after = self._pieces(prev, role)
        s = before + text + after
        if prev == "assistant" and action_ids and action_ids[-1] in self.stop_ids:
            for st in self.stop_text:
                if s.startswith(st):
                    s = s[len(st):]
                    break
        return self.encode(s)
