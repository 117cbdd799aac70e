"""The text protocol, a leaf package (it imports nothing else from supo_jax): the tool-call
format and its parser, summary tags, the default summary / continuation templates, and the
reader of a working context that scripted experts use. `agent/` and `envs/` build on it."""
from supo_jax.text.parsing import (ParsedAction, extract_summary, format_tool_call,
                                   parse_action, quote)
from supo_jax.text.reading import MAX_SUMMARY_CHARS, continuation_marker, read_context
from supo_jax.text.templates import (CONTINUATION, SHORT_SUMMARY_INSTRUCTION,
                                     SUMMARY_INSTRUCTION)

__all__ = ["CONTINUATION", "MAX_SUMMARY_CHARS", "ParsedAction", "SHORT_SUMMARY_INSTRUCTION",
           "SUMMARY_INSTRUCTION", "continuation_marker", "extract_summary", "format_tool_call",
           "parse_action", "quote", "read_context"]
