"""Context managers: pure functions over an immutable rollout state.

One interface. After every policy turn the manager decides the next working
context, whether a segment (a training row) ends, and which tokens are trained:

    after_action(cfg, fmt, state, action, observation, obs_done) -> state
    after_summary(cfg, fmt, state, summary) -> state

`state.phase` then says what the policy is asked next: "act" (the working
context + generation prompt), "summarize" (context + summary instruction +
generation prompt) or "done" (with `state.reason`).

No request plus its output, and no training row, exceeds ContextConfig.row_bound tokens:
W, except for a summary under the paper's rule. An action's budget is min(max_action_tokens,
W - request length) (under `state` and `clear`, max_action_tokens + max_state_tokens: the
reply's state block has a budget of its own). The manager acts at L (ContextConfig.trigger_rule):
  paper    L = floor(trigger_ratio * W), the paper's 0.95 W (clamped to W - generation
           prompt - 1, so that an action always has a token of room; this binds only when
           W is below ~20 generation prompts). As in the paper (docs/SUPO.md §2), the summary
           has a budget of its own beyond W: a summary request (the context before the
           dropped pair, below L, + instruction + generation prompt) gets max_summary_tokens,
           so W is soft and a row is bounded by L + instruction + generation prompt + max
           summary tokens.
  reserve  L = min(trigger_ratio * W, W - reserve), where reserve is what a summary request
           still needs after the context (instruction + generation prompt + max summary
           tokens; for managers that never summarize, the generation prompt + 1 token): a
           context below L always leaves room for the next action and for a full summary,
           and W is hard.
A summary cut at its budget (no stop token) is never trained or used as if whole: the
rollout ends there, reason summary_cut (no answer, so overlong-masked), its last row ending
with the last action.
The summary instruction is a `summary_role` turn (system, as in the paper, or user).

Managers (ContextConfig.manager):
  supo               docs/SUPO.md §2: when len(context + action + observation) >= L,
                     drop that action/observation from the context (the env keeps
                     its effect), ask for a summary, close the segment with it,
                     restart from the initial prompt + continuation + summary.
                     An action cut at its budget (W reached) is such an overflow. When
                     the summary cap S or the step cap H stops the rollout at that
                     point, the overflowing action is dropped the same way (never
                     trained); with show_dropped_to_summarizer, the dropped pair is
                     shown only when the summary request still fits.
  full               vanilla multi-turn: the context grows; reaching L ends the
                     rollout (context_limit).
  truncate           drop the oldest turns until the context fits below L.
  window             keep only the last `window_turns` turns.
  state              MEM1-style per-turn state: the task prompt asks every reply to begin
                     with <state></state> (STATE_INSTRUCTION), within max_state_tokens
                     beside the call's max_action_tokens (0: sized from W, reply_budget);
                     after every turn the context is s1 + the latest action + its observation (window with one turn,
                     every turn): each turn closes a row whose action (state and call) is
                     trained. A reply without a state block is kept as written (the agent
                     has then lost what it did not restate; `states` counts the blocks);
                     a latest turn that alone reaches L ends the rollout (context_limit).
  fold               context folding (FoldGRPO-style): the tools shown gain `branch` and
                     `return` (FOLD_TOOLS; the rollout driver runs them, not the
                     environment). branch(description) opens a sub-task whose turns
                     follow in the context; return(message) replaces the branch's
                     turns by the branch call and a tool turn holding the message (then
                     a user request that came inside the branch), and closes a row (the
                     rows share the rollout's advantage). An action's budget is
                     max_action_tokens + max_summary_tokens: a return's message is the
                     branch's summary, and what a branch leaves in the main thread (its
                     call and message) is bounded as a summary is. One level:
                     a branch inside a branch, a return outside one, or a branch past
                     max_branches is an error observation. At L inside a branch the
                     branch is folded with FORCED_RETURN; at L in the main thread the
                     rollout ends (context_limit).
  clear              tool-result clearing: the oldest observations are replaced by a
                     short placeholder (CLEARED) until the context fits below L;
                     nothing is trained differently (a context cleared starts a new
                     segment, as truncate's does). The task prompt asks every reply to
                     begin with <state></state> (CLEAR_INSTRUCTION, budgeted as under
                     `state`): the replies stay, so their state keeps what a cleared result
                     said (`states` counts the blocks). The replies still grow the context:
                     `clear_exhausted` counts the times it reached L with every older
                     result already cleared (the newest, not yet acted on, is then cleared
                     too; if that is not enough the rollout ends, context_limit).
  frozen_summarizer  like supo, but the summary comes from a separate frozen
                     policy and its tokens are not trained (ReSum-style).
A context that is not an append-only continuation of the previous one starts a
new segment; tokens carried over into it are context there (mask 0).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

from supo_jax.agent.render import ChatFormat
from supo_jax.text.parsing import fold_call  # noqa: F401  (the fold manager's tools, parsed)
from supo_jax.text.templates import (CLEAR_INSTRUCTION, CONTINUATION, FOLD_TOOLS,  # noqa: F401
                                     FORCED_RETURN, STATE_INSTRUCTION, SUMMARY_INSTRUCTION)

MANAGERS = ("supo", "full", "truncate", "window", "frozen_summarizer", "clear", "state", "fold")
# managers whose actions take a form other managers' demonstrations never show (a <state>
# block; the branch and return tools): a comparison warm-starts them on their own demonstrations
OWN_DEMONSTRATIONS = ("state", "clear", "fold")
CLEARED = "[tool result cleared]"   # what a cleared observation reads
TRIGGER_RULES = ("paper", "reserve")
SUMMARY_ROLES = ("system", "user")
REASONS = ("answer", "max_summaries", "max_steps", "context_limit", "env_error", "timeout",
           "summary_cut", "queued")
# reasons where the environment failed the rollout; "queued": it waited for a free worker
# (a pool of simulator processes, e.g. BFCL's) past that wait's own bound, and never ran
ENV_FAILURES = ("env_error", "timeout", "queued")
NO_ANSWER = REASONS[1:]   # the rollout ended without an answer (overlong masking masks these)


@dataclasses.dataclass(frozen=True)
class ContextConfig:
    manager: str = "supo"
    working_context: int = 4096        # W (tokens)
    trigger_ratio: float = 0.95        # L = trigger_ratio * W
    trigger_rule: str = "paper"        # paper: L = trigger_ratio * W | reserve: min(that,
                                       # W - room for a full summary request); module doc
    max_summaries: int = 7             # S
    max_steps: int = 100               # H (a summary turn counts as a step)
    max_action_tokens: int = 256
    max_summary_tokens: int = 512
    max_observation_tokens: int = 512  # longer observations are cut (and say so)
    summary_instruction: str = SUMMARY_INSTRUCTION
    summary_role: str = "system"       # the instruction's turn: system (the paper) | user
    continuation: str = CONTINUATION   # {prompt} is the task prompt, {summary} the summary
    show_dropped_to_summarizer: bool = False
    window_turns: int = 4
    summary_counts_as_step: bool = True
    state_instruction: str = STATE_INSTRUCTION   # state: appended to the task prompt
    clear_instruction: str = CLEAR_INSTRUCTION   # clear: appended to the task prompt
    max_state_tokens: int = 0          # state, clear: a reply's <state> block, beyond
                                       # max_action_tokens; 0 (auto): what L leaves beside
                                       # the task's prompt, the action and one observation
    max_branches: int = 8                        # fold: branches a rollout may open

    def __post_init__(self):
        if self.manager not in MANAGERS:
            raise ValueError(f"context.manager={self.manager!r} is not one of {', '.join(MANAGERS)}")
        for f, allowed in (("trigger_rule", TRIGGER_RULES), ("summary_role", SUMMARY_ROLES)):
            if getattr(self, f) not in allowed:
                raise ValueError(f"context.{f}={getattr(self, f)!r} is not one of "
                                 f"{', '.join(allowed)}")
        if not 0 < self.trigger_ratio <= 1:
            raise ValueError(f"context.trigger_ratio must be in (0, 1], got {self.trigger_ratio}")
        for f in ("working_context", "max_steps", "max_action_tokens", "max_summary_tokens",
                  "max_observation_tokens", "window_turns"):
            if getattr(self, f) <= 0:
                raise ValueError(f"context.{f} must be positive, got {getattr(self, f)}")
        if self.max_state_tokens < 0:
            raise ValueError("context.max_state_tokens must be >= 0 (0: sized from W), got "
                             f"{self.max_state_tokens}")
        if self.max_summaries < 0:
            raise ValueError("context.max_summaries must be >= 0")
        if "{summary}" not in self.continuation:
            raise ValueError("context.continuation must contain {summary}")

    @property
    def trigger(self) -> int:
        """L: the working-context length at which the manager acts."""
        return int(self.trigger_ratio * self.working_context)

    @property
    def summarizes(self) -> bool:
        return self.manager in ("supo", "frozen_summarizer")

    def reserve(self, fmt: ChatFormat) -> int:
        """Tokens a context below L leaves free: a summary request's instruction, generation
        prompt and summary (summarizing managers; with show_dropped_to_summarizer also the
        dropped action and observation), else the generation prompt + 1."""
        gp = len(fmt.gen_prompt)
        if not self.summarizes:
            return gp + 1
        n = self.instruction_len(fmt) + gp + self.max_summary_tokens
        if self.show_dropped_to_summarizer:     # room for the dropped action + observation too
            n += gp + self.max_action_tokens + self.max_observation_tokens + len(
                fmt.turn("assistant", "tool", ""))
        return n

    def instruction_len(self, fmt: ChatFormat) -> int:
        """Tokens of the summary instruction's turn after a user or a tool turn (the longer)."""
        return fmt.instruction_len(self.summary_instruction, self.summary_role)

    def limit(self, fmt: ChatFormat) -> int:
        """The effective L (trigger_rule): paper min(trigger, W - generation prompt - 1),
        reserve min(trigger, W - reserve(fmt))."""
        if self.trigger_rule == "paper":
            return min(self.trigger, self.working_context - len(fmt.gen_prompt) - 1)
        return min(self.trigger, self.working_context - self.reserve(fmt))

    def row_bound(self, fmt: ChatFormat | None) -> int:
        """KV-cache slots a row needs and the longest training row: W, or under the paper's
        rule for a summarizing manager L + instruction + generation prompt + max summary
        tokens when that is more (a summary's own budget beyond W). fmt None (no tokenizer
        at hand, e.g. planning a model without one): an upper bound that counts the
        instruction's turn as a token a byte plus 32."""
        if self.trigger_rule != "paper" or not self.summarizes:
            return self.working_context
        if fmt is None:
            instr, gp = len(self.summary_instruction.encode()) + 32, 32
            limit = self.trigger
        else:
            instr, gp, limit = self.instruction_len(fmt), len(fmt.gen_prompt), self.limit(fmt)
        return max(self.working_context, limit + instr + gp + self.max_summary_tokens)

    def budget(self, request_len: int, summary: bool, reply: int = 0) -> int:
        """Tokens a generation may add to a request of request_len tokens: its max (an
        action's: `reply`, the rollout's reply_budget, else action_tokens), capped by the room
        left in W (a summary under the paper's rule: its max, beyond W)."""
        if summary:
            if self.trigger_rule == "paper":
                return self.max_summary_tokens
            return min(self.max_summary_tokens, self.working_context - request_len)
        return min(reply or self.action_tokens, self.working_context - request_len)

    @property
    def state_request(self) -> str:
        """What the task prompt ends with, asking every reply to begin with a <state></state>
        block (state: state_instruction, clear: clear_instruction), or "" where nothing is."""
        return {"state": self.state_instruction, "clear": self.clear_instruction}.get(
            self.manager, "")

    @property
    def action_tokens(self) -> int:
        """An action's own budget: max_action_tokens, and where the prompt asks for a <state>
        block (state, clear) its max_state_tokens beside it (a reply holds both; W still
        bounds the two together). Sized from W (max_state_tokens 0): W, the bound that
        reply_budget's figure for each task stays under. fold: max_action_tokens +
        max_summary_tokens (a return's message is the branch's summary: what it leaves in the
        main thread is bounded as a summary is)."""
        if self.manager == "fold":   # a return call carries the branch's summary
            return self.max_action_tokens + self.max_summary_tokens
        if not self.state_request:
            return self.max_action_tokens
        if not self.max_state_tokens:          # sized from W: W bounds it
            return self.working_context
        return self.max_action_tokens + self.max_state_tokens

    def reply_budget(self, fmt: ChatFormat, prompt_len: int) -> int:
        """An action's own budget in a rollout whose initial prompt holds prompt_len tokens:
        action_tokens; with a <state> block sized from W (max_state_tokens 0), what L leaves
        beside the prompt, the generation prompt and one observation turn of
        max_observation_tokens, so that the latest turn alone stays below L (under `state`
        the context is the prompt and that turn; under `clear`, once every result is cleared,
        the prompt and the replies)."""
        if not self.state_request or self.max_state_tokens:
            return self.action_tokens
        obs_turn = self.max_observation_tokens + len(fmt.turn("assistant", "tool", ""))
        return self.limit(fmt) - 1 - prompt_len - len(fmt.gen_prompt) - obs_turn


@dataclasses.dataclass(frozen=True)
class Segment:
    """One training row: token ids, loss mask (1 = generated here), sampler logprobs."""
    tokens: tuple[int, ...]
    mask: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __len__(self):
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class Turn:
    """An action the policy sampled: ids (ending with a stop token unless cut) and logprobs."""
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str


@dataclasses.dataclass(frozen=True)
class RolloutState:
    prompt_text: str
    prefix: tuple[int, ...]            # s1 (closed): reused as-is after every summary
    tokens: tuple[int, ...]            # current working context == open segment
    mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    turns: tuple[tuple[int, int], ...] = ()   # (start, end) of each action+observation in tokens
    obs_starts: tuple[int, ...] = ()   # where each turn's observation starts in tokens
    cleared: int = 0                   # clear: the oldest turns whose tool results are cleared
    states: int = 0                    # state: the actions that carried a <state> block
    # fold: the open branch as (its call's turn index, message index), () in the main thread
    branch: tuple[int, ...] = ()
    folds: int = 0                     # fold: branches opened
    results_cleared: int = 0           # clear: tool results replaced by CLEARED
    # clear: times the context reached L with every result before the newest already cleared
    # (the newest, not yet acted on, was then cleared too, or the rollout ended)
    clear_exhausted: int = 0
    last_role: str = "user"            # role of the turn that closes `tokens`
    messages: tuple[dict, ...] = ()    # the working context as chat messages
    segments: tuple[Segment, ...] = ()
    phase: str = "act"
    reason: str | None = None
    reward: float = 0.0
    steps: int = 0
    tool_calls: int = 0
    summaries: int = 0
    generated_tokens: int = 0
    summary_lengths: tuple[int, ...] = ()
    max_context: int = 0               # longest sequence the policy attended over (request + output)
    pending: tuple[int, ...] = ()      # the summary request's context (context + instruction)
    attended: int = 0                  # sum of the closed working contexts' longest sequences
    segment_peak: int = 0              # longest sequence attended in the open working context
    # actions the manager dropped from the context (they reached L), each as context + action
    # with the action alone trained: never RL rows (SUPO drops them), but valid SFT targets
    dropped: tuple[Segment, ...] = ()
    # the latest user request the environment delivered after the initial prompt (role "user"
    # observations): a summary restart keeps it, after the continuation
    user_turn: str = ""
    reply_budget: int = 0              # an action's own budget (ContextConfig.reply_budget)

    @property
    def context_len(self) -> int:
        return len(self.tokens)

    @property
    def effective_context(self) -> int:
        """Effective context used: the longest sequence attended in each working context
        (segment), summed over the rollout's working contexts (<= W * (S + 1) under supo)."""
        return self.attended + self.segment_peak


def state_to_json(state: RolloutState) -> dict:
    """A rollout state as JSON values (a suspended rollout in a checkpoint); state_from_json
    reads it back equal."""
    d = {}
    for f in dataclasses.fields(RolloutState):
        v = getattr(state, f.name)
        if f.name in ("segments", "dropped"):
            v = [[list(s.tokens), list(s.mask), list(s.logprobs)] for s in v]
        elif f.name == "messages":
            v = [dict(m) for m in v]
        elif isinstance(v, tuple):
            v = [list(x) if isinstance(x, tuple) else x for x in v]
        d[f.name] = v
    return d


def state_from_json(d: dict) -> RolloutState:
    kw = {}
    for f in dataclasses.fields(RolloutState):
        if f.name not in d:       # a field added since the state was saved: its default
            continue
        v = d[f.name]
        if f.name in ("segments", "dropped"):
            v = tuple(Segment(tuple(t), tuple(m), tuple(lp)) for t, m, lp in v)
        elif f.name == "messages":
            v = tuple(dict(m) for m in v)
        elif isinstance(v, list):
            v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        kw[f.name] = v
    return RolloutState(**kw)


def initial_state(fmt: ChatFormat, messages: Sequence[dict], tools=None) -> RolloutState:
    prefix = tuple(fmt.prompt(list(messages), tools))
    prompt_text = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    return RolloutState(prompt_text=prompt_text, prefix=prefix, tokens=prefix,
                        mask=(0,) * len(prefix), logprobs=(0.0,) * len(prefix),
                        messages=tuple(messages), max_context=len(prefix))


def request_tokens(fmt: ChatFormat, state: RolloutState) -> tuple[int, ...]:
    """What the policy sees when asked for its next turn (context + generation prompt)."""
    base = state.pending if state.phase == "summarize" else state.tokens
    return tuple(base) + tuple(fmt.gen_prompt)


def finish(state: RolloutState, reason: str, reward: float = 0.0, close: bool = True,
           end: int | None = None) -> RolloutState:
    """End the rollout with `reason`; the open segment (cut at `end`: the policy never saw an
    observation that followed its last action) becomes a row if it holds trained tokens."""
    segs = state.segments
    if close and any(state.mask[:end]):
        segs = segs + (_segment(state, end),)
    return dataclasses.replace(state, phase="done", reason=reason, reward=reward, segments=segs)


def _segment(state: RolloutState, end: int | None = None) -> Segment:
    return Segment(state.tokens[:end], state.mask[:end], state.logprobs[:end])


def _extend(state: RolloutState, ids, mask_bit: int, lps=None) -> dict:
    ids = tuple(ids)
    return dict(tokens=state.tokens + ids, mask=state.mask + (mask_bit,) * len(ids),
                logprobs=state.logprobs + (tuple(lps) if lps is not None else (0.0,) * len(ids)))


class _Applied(NamedTuple):
    """One action and its observation appended to the context, before the manager acts."""
    before: RolloutState        # the state the action was sampled in
    with_action: RolloutState   # + generation prompt + action (trained)
    grown: RolloutState         # + the observation turn
    action: Turn

    @property
    def end(self) -> int:
        """Where a row ends that the observation's tokens are not in: after the action."""
        return len(self.with_action.tokens)


def after_action(cfg: ContextConfig, fmt: ChatFormat, state: RolloutState, action: Turn,
                 observation: str | None, done: bool, reward: float = 0.0,
                 tool_call: bool = True, role: str = "tool") -> RolloutState:
    """Apply one action and its environment result. observation=None when the action answered;
    role "user" when the observation is a new user request (kept after a summary restart).
    Below the manager's limit the context just grows; at it, _ON_LIMIT[cfg.manager] acts."""
    with_action = _append_action(fmt, state, action, tool_call and not done)
    if cfg.state_request:
        from supo_jax.text.parsing import extract_state

        with_action = dataclasses.replace(
            with_action, states=state.states + (extract_state(action.text) is not None))
    if done:
        return finish(with_action, "answer", reward)
    grown = _append_observation(fmt, state, with_action, action, observation, role)
    a = _Applied(state, with_action, grown, action)
    limit = cfg.limit(fmt)
    if not _at_limit(cfg, grown, limit):
        return finish(grown, "max_steps", end=a.end) if grown.steps >= cfg.max_steps else grown
    return _ON_LIMIT[cfg.manager](cfg, fmt, a, limit)


def _append_action(fmt: ChatFormat, state: RolloutState, action: Turn,
                   tool_call: bool) -> RolloutState:
    """state + generation prompt (context) + action (trained): one step, a tool call if one."""
    s = dataclasses.replace(
        state, steps=state.steps + 1, tool_calls=state.tool_calls + int(tool_call),
        generated_tokens=state.generated_tokens + len(action.tokens),
        **_extend(state, fmt.gen_prompt, 0))
    s = dataclasses.replace(s, **_extend(s, action.tokens, 1, action.logprobs))
    return dataclasses.replace(s, max_context=max(state.max_context, len(s.tokens)),
                               segment_peak=max(state.segment_peak, len(s.tokens)))


def _append_observation(fmt: ChatFormat, state: RolloutState, with_action: RolloutState,
                        action: Turn, observation: str, role: str = "tool") -> RolloutState:
    """with_action + the observation turn (context), recorded as a turn and two messages; a
    user turn also becomes the rollout's current request."""
    obs_ids = tuple(fmt.turn("assistant", role, observation, action.tokens))
    return dataclasses.replace(
        with_action, **_extend(with_action, obs_ids, 0), last_role=role,
        turns=state.turns + ((len(state.tokens), len(with_action.tokens) + len(obs_ids)),),
        obs_starts=state.obs_starts + (len(with_action.tokens),),
        messages=state.messages + ({"role": "assistant", "content": action.text},
                                   {"role": role, "content": observation}),
        user_turn=observation if role == "user" else state.user_turn)


def _at_limit(cfg: ContextConfig, grown: RolloutState, limit: int) -> bool:
    """Whether the manager acts: the context reached L (window: or holds > window_turns turns)."""
    too_many_turns = (cfg.manager == "window" and len(grown.turns) > cfg.window_turns
                      or cfg.manager == "state" and len(grown.turns) > 1)
    return too_many_turns or grown.context_len >= limit


def _end_at_limit(cfg: ContextConfig, fmt: ChatFormat, a: _Applied, limit: int) -> RolloutState:
    """full: reaching L ends the rollout; the row ends with the action."""
    return finish(a.grown, "context_limit", end=a.end)


def _summarize(cfg: ContextConfig, fmt: ChatFormat, a: _Applied, limit: int) -> RolloutState:
    """supo / frozen_summarizer: the pair that reached L leaves the context (kept as a dropped
    row) and the policy is asked for a summary; reaching S or H, or a W that leaves no room
    for a summary request, ends the rollout instead."""
    state, grown = a.before, a.grown
    dropped = state.dropped + (_dropped_row(fmt, a),)
    if state.summaries >= cfg.max_summaries:
        return _end_dropping(a, dropped, "max_summaries")
    if grown.steps >= cfg.max_steps:
        return _end_dropping(a, dropped, "max_steps")
    gp, bound = len(fmt.gen_prompt), cfg.row_bound(fmt)
    # shown to the summarizer only if the summary request still fits the row bound
    need = cfg.instruction_len(fmt) + gp + cfg.max_summary_tokens
    show = cfg.show_dropped_to_summarizer and grown.context_len + need <= bound
    base = grown if show else state
    instr = tuple(fmt.turn(base.last_role, cfg.summary_role, cfg.summary_instruction))
    room = bound - cfg.max_summary_tokens if cfg.trigger_rule == "paper" else bound - 1
    if len(base.tokens) + len(instr) + gp > room:   # no room for a summary
        return _end_dropping(a, dropped, "context_limit")
    # the dropped pair's tokens stay in this segment only if shown to the summarizer
    # (a user turn in the dropped pair is the current request all the same: the restart
    # keeps it)
    seg_state = grown if show else dataclasses.replace(
        state, steps=grown.steps, tool_calls=grown.tool_calls,
        generated_tokens=grown.generated_tokens, max_context=grown.max_context,
        segment_peak=grown.segment_peak, user_turn=grown.user_turn)
    return dataclasses.replace(
        seg_state, dropped=dropped, phase="summarize", pending=base.tokens + instr,
        messages=base.messages + ({"role": cfg.summary_role, "content": cfg.summary_instruction},))


def _dropped_row(fmt: ChatFormat, a: _Applied) -> Segment:
    """The dropped action as context + action, the action alone trained."""
    n_ctx = len(a.before.tokens) + len(fmt.gen_prompt)
    return Segment(a.with_action.tokens, (0,) * n_ctx + (1,) * len(a.action.tokens),
                   a.with_action.logprobs)


def _end_dropping(a: _Applied, dropped: tuple[Segment, ...], reason: str) -> RolloutState:
    """End the rollout with the pair dropped: the row ends with the last action the policy saw
    answered."""
    mask = a.before.mask
    last = max((i + 1 for i, m in enumerate(mask) if m), default=len(a.before.tokens))
    return finish(dataclasses.replace(a.grown, dropped=dropped), reason, end=last)


def _cut(cfg: ContextConfig, fmt: ChatFormat, a: _Applied, limit: int) -> RolloutState:
    """truncate/window/state: drop the oldest turns (window: all but the last window_turns;
    state: all but the last) until the context is below L; the cut context starts a new
    segment. state: a last turn that alone reaches L ends the rollout."""
    state, end = a.grown, a.end
    turns = list(zip(state.turns, state.obs_starts))
    last = {"window": cfg.window_turns, "state": 1}.get(cfg.manager)
    keep = turns[-last:] if last else turns
    start_len = len(state.prefix)

    def size(ts):
        return start_len + sum(e - s for (s, e), _ in ts)

    while keep and size(keep) >= limit:
        keep = keep[1:]
    if not keep and (size(keep) >= limit or cfg.manager == "state"):
        return finish(state, "context_limit", end=end)
    segs = state.segments + ((_segment(state, end),) if any(state.mask) else ())
    toks, new_turns, obs = state.prefix, [], []
    for (s, e), o in keep:
        new_turns.append((len(toks), len(toks) + e - s))
        obs.append(len(toks) + o - s)
        toks = toks + state.tokens[s:e]
    n_msgs = 2 * len(keep)
    head = tuple(m for m in state.messages if m["role"] in ("system",)) + (
        next(m for m in state.messages if m["role"] == "user"),)
    new = dataclasses.replace(state, segments=segs, tokens=toks, mask=(0,) * len(toks),
                              logprobs=(0.0,) * len(toks), turns=tuple(new_turns),
                              obs_starts=tuple(obs),
                              attended=state.attended + state.segment_peak, segment_peak=0,
                              messages=head + (state.messages[-n_msgs:] if n_msgs else ()),
                              last_role=state.messages[-1]["role"] if keep else "user")
    return finish(new, "max_steps", close=False) if state.steps >= cfg.max_steps else new


def _clear(cfg: ContextConfig, fmt: ChatFormat, a: _Applied, limit: int) -> RolloutState:
    """clear: the oldest tool observations not yet cleared become CLEARED, one at a time, until
    the context is below L (every one cleared and still not: context_limit); user turns stay,
    and so do results shorter than CLEARED.
    The rewritten context starts a new segment, its actions context there (they were trained
    where sampled)."""
    state, end = a.grown, a.end
    n_head = len(state.messages) - 2 * len(state.turns)    # the initial messages
    pieces = []          # per turn: (action part, observation part, cleared)
    for i, ((s, e), o) in enumerate(zip(state.turns, state.obs_starts)):
        pieces.append([state.tokens[s:o], state.tokens[o:e], i < state.cleared])
    size = len(state.prefix) + sum(len(x) + len(y) for x, y, _ in pieces)
    k, exhausted = state.cleared, 0
    while size >= limit and k < len(pieces):
        exhausted = int(k == len(pieces) - 1)   # only the newest result is left to clear
        act, old, _ = pieces[k]
        role = state.messages[n_head + 2 * k + 1]["role"]
        new = tuple(fmt.turn("assistant", role, CLEARED, act[len(fmt.gen_prompt):]))
        if role == "tool" and len(new) < len(old):   # a user turn (a new request) is kept,
            size += len(new) - len(old)               # and a result shorter than CLEARED
            pieces[k] = [act, new, True]
        k += 1
    state = dataclasses.replace(state, clear_exhausted=state.clear_exhausted + exhausted)
    if size >= limit:
        return finish(state, "context_limit", end=end)
    segs = state.segments + ((_segment(state, end),) if any(state.mask) else ())
    toks, turns, obs = state.prefix, [], []
    for act, ob, _ in pieces:
        turns.append((len(toks), len(toks) + len(act) + len(ob)))
        obs.append(len(toks) + len(act))
        toks = toks + act + ob
    msgs = list(state.messages)
    for i in range(state.cleared, k):
        if pieces[i][2]:
            msgs[n_head + 2 * i + 1] = {**msgs[n_head + 2 * i + 1], "content": CLEARED}
    new = dataclasses.replace(state, segments=segs, tokens=toks, mask=(0,) * len(toks),
                              logprobs=(0.0,) * len(toks), turns=tuple(turns),
                              obs_starts=tuple(obs), cleared=k, messages=tuple(msgs),
                              results_cleared=state.results_cleared + sum(
                                  p[2] for p in pieces[state.cleared:k]),
                              attended=state.attended + state.segment_peak, segment_peak=0)
    return finish(new, "max_steps", close=False) if state.steps >= cfg.max_steps else new


def _fold_at_limit(cfg: ContextConfig, fmt: ChatFormat, a: _Applied, limit: int) -> RolloutState:
    """fold: at L inside a branch, the branch folds with FORCED_RETURN (the last action closes
    the row); in the main thread, or when even the folded context reaches L, the rollout
    ends (context_limit)."""
    if not a.grown.branch:
        return finish(a.grown, "context_limit", end=a.end)
    return _fold(cfg, fmt, a.with_action, FORCED_RETURN, limit)


def _fold(cfg: ContextConfig, fmt: ChatFormat, state: RolloutState, message: str,
          limit: int) -> RolloutState:
    """The open branch folded: the context up to and including the branch call, then a tool
    turn holding `message`, then the user's latest request if one came inside the branch
    (it stays in view, as a summary restart keeps it); the row so far closes (state ends
    with its last action)."""
    k, m = state.branch
    (s, _), o = state.turns[k], state.obs_starts[k]
    call = state.tokens[s:o]
    obs = tuple(fmt.turn("assistant", "tool", message, call[len(fmt.gen_prompt):]))
    msgs = ({"role": "tool", "content": message},)
    asked = [x["content"] for x in state.messages[m + 1:] if x.get("role") == "user"]
    if asked:
        obs += tuple(fmt.turn("tool", "user", asked[-1]))
        msgs += ({"role": "user", "content": asked[-1]},)
    toks = state.tokens[:o] + obs
    segs = state.segments + ((_segment(state),) if any(state.mask) else ())
    new = dataclasses.replace(
        state, segments=segs, tokens=toks, mask=(0,) * len(toks), logprobs=(0.0,) * len(toks),
        turns=state.turns[:k] + ((s, len(toks)),), obs_starts=state.obs_starts[:k] + (o,),
        messages=state.messages[:m + 1] + msgs, last_role=msgs[-1]["role"], branch=(),
        attended=state.attended + state.segment_peak, segment_peak=0)
    if len(toks) >= limit:
        return finish(new, "context_limit", close=False)
    return finish(new, "max_steps", close=False) if new.steps >= cfg.max_steps else new


def after_fold(cfg: ContextConfig, fmt: ChatFormat, state: RolloutState, action: Turn,
               name: str, argument: str) -> RolloutState:
    """fold: an action calling `branch` (argument: its description) or `return` (its
    message). A branch opens (its call and an observation stay in the context); a return
    folds the open branch (_fold); out of turn (a branch inside a branch, past
    max_branches, a return outside a branch) the action gets an error observation."""
    if name == "error":                  # a call of branch / return that does not validate
        err = argument
    elif name == "branch" and state.branch:
        err = "error: a branch is open; call return before opening another"
    elif name == "branch" and state.folds >= cfg.max_branches:
        err = f"error: no branches left (context.max_branches = {cfg.max_branches})"
    elif name == "return" and not state.branch:
        err = "error: no branch is open"
    else:
        err = None
    if err is not None or name == "branch":
        out = after_action(cfg, fmt, state, action, err or f"Branch opened: {argument}", False,
                           tool_call=True)
        if err is None and out.phase == "act" and len(out.turns) == len(state.turns) + 1:
            out = dataclasses.replace(out, branch=(len(state.turns), len(state.messages)),
                                      folds=state.folds + 1)
        return out
    return _fold(cfg, fmt, _append_action(fmt, state, action, True), argument, cfg.limit(fmt))


# what each manager does when the context reaches its limit (after_action)
_ON_LIMIT = {"full": _end_at_limit, "truncate": _cut, "window": _cut, "supo": _summarize,
             "frozen_summarizer": _summarize, "clear": _clear, "state": _cut,
             "fold": _fold_at_limit}
assert set(_ON_LIMIT) == set(MANAGERS)


def after_summary(cfg: ContextConfig, fmt: ChatFormat, state: RolloutState, summary: Turn,
                  trained: bool = True) -> RolloutState:
    """Close the segment with the summary and restart from s1 + continuation(summary), then
    the current user request when the environment delivered one after s1 (state.user_turn)."""
    from supo_jax.text.parsing import extract_summary

    gp = tuple(fmt.gen_prompt)
    instr = state.pending[len(state.tokens):]
    if not summary.tokens or summary.tokens[-1] not in fmt.stop_ids:   # cut at its budget
        last = max((i + 1 for i, m in enumerate(state.mask) if m), default=len(state.tokens))
        return finish(dataclasses.replace(
            state, generated_tokens=state.generated_tokens + len(summary.tokens),
            max_context=max(state.max_context, len(state.pending) + len(gp)
                            + len(summary.tokens))), "summary_cut", end=last)
    seg = dataclasses.replace(state, **_extend(state, instr + gp, 0))
    seg = dataclasses.replace(seg, **_extend(seg, summary.tokens, 1 if trained else 0,
                                             summary.logprobs))
    segments = state.segments + ((_segment(seg),) if any(seg.mask) else ())
    text = extract_summary(summary.text)
    if text is None:
        text = summary.text.strip()
    cont_text = cfg.continuation.format(prompt=state.prompt_text, summary=text)
    cont = tuple(fmt.turn("user", "user", cont_text))
    current = ({"role": "user", "content": state.user_turn},) if state.user_turn else ()
    if state.user_turn:   # the request being worked on (a later user turn) stays in view
        cont += tuple(fmt.turn("user", "user", state.user_turn))
    steps = state.steps + int(cfg.summary_counts_as_step)
    first_msgs = tuple(m for m in state.messages[:2] if m["role"] in ("system", "user"))[:2]
    new = dataclasses.replace(
        state, phase="act", pending=(), segments=segments,
        tokens=state.prefix + cont, mask=(0,) * (len(state.prefix) + len(cont)),
        logprobs=(0.0,) * (len(state.prefix) + len(cont)), turns=(), obs_starts=(),
        last_role="user",
        messages=first_msgs + ({"role": "user", "content": cont_text},) + current,
        summaries=state.summaries + 1, steps=steps,
        generated_tokens=state.generated_tokens + len(summary.tokens),
        summary_lengths=state.summary_lengths + (len(summary.tokens),),
        max_context=max(state.max_context, len(seg.tokens)),
        attended=state.attended + max(state.segment_peak, len(seg.tokens)), segment_peak=0)
    if steps >= cfg.max_steps:
        return finish(new, "max_steps", close=False)
    if new.context_len >= cfg.limit(fmt):  # the summary alone does not fit the budget
        return finish(new, "context_limit", close=False)
    return new
