"""Default text of the SUPO summary turn and of the continuation prompt (docs/SUPO.md §2)."""

SUMMARY_INSTRUCTION = (
    "The conversation history is too long to continue. Write a summary of the work so far that "
    "keeps everything needed to continue solving the task: what is known, what has been done, "
    "the current state and exactly what to do next. Do not call any tool in this turn. "
    "Put the summary inside <summary></summary>."
)

# A short instruction for small CPU-scale policies, whose rows must stay short.
SHORT_SUMMARY_INSTRUCTION = "Context full. Summarize the state in <summary></summary>, no tool call."

# The state manager (MEM1-style): appended to the task prompt; the context keeps only the task,
# the latest reply and its result, so the reply must carry what the agent needs to remember.
STATE_INSTRUCTION = (
    "Only the task, your latest reply and its result stay in view. Begin every reply with "
    "<state></state> holding everything you need to remember (what is known, what is done, "
    "what to do next), then call a tool.")

# The clear manager: appended to the task prompt; old tool results leave the context, the
# replies stay, so a reply's state is what keeps what a cleared result said.
CLEAR_INSTRUCTION = (
    "Old tool results are cleared from view as the conversation grows; your replies stay. "
    "Begin every reply with <state></state> holding everything you need to remember (what is "
    "known, what is done, what to do next), then call a tool.")

# A user turn placed right after the initial prompt s1 (which already holds the task), so the
# restarted context is s1 + this turn. "{prompt}" may also be used to repeat the task.
CONTINUATION = "We are in the following stage of solving the problem:\n<summary>\n{summary}\n</summary>"

# fold: the tools the driver adds (OpenAI / transformers chat-template tool dicts)
FOLD_TOOLS = (
    {"type": "function", "function": {
        "name": "branch", "description": "Open a sub-task. Its turns leave the context when "
        "you call return; only your return message stays.",
        "parameters": {"type": "object", "properties": {"description": {"type": "string"}},
                       "required": ["description"]}}},
    {"type": "function", "function": {
        "name": "return", "description": "Close the open sub-task with what it found.",
        "parameters": {"type": "object", "properties": {"message": {"type": "string"}},
                       "required": ["message"]}}},
)
FORCED_RETURN = "[the branch reached the context limit and was closed]"
