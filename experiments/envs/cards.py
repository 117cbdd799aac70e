"""`cards`: one red card among 12-15, found with read(i). The README's environment example
until 2026-11-26 (then `redcount`, which needs RL: from 600 SFT steps this one's warm start
solves all but the tasks with card 12 red, and RL holds it). Kept as written then, so its
results in experiments/results/ (cards_*) rerun: from the repository root,

    supo-jax sweep --set 'env.imports=["experiments.envs.cards"]' --set env.name=cards \
        --seeds 0,1,2 --grid context.manager=supo,full --out runs/cards_families
"""
import random
import re

from supo_jax.envs.base import Environment, Reset, StepResult, ToolSpec, register_env
from supo_jax.envs.experts import StateExpert, register_expert

def tasks(split, n, seed=0, size=12):
    rng = random.Random(f"{split}:{seed}")   # train and eval: disjoint streams
    out = []
    for i in range(n):
        cards = size + i % 4
        out.append({"task_id": f"cards:{split}:{seed}:{i}", "family": "cards", "cards": cards,
                    "red": rng.randrange(cards)})
    return out

@register_env("cards", tasks=tasks)
class Cards(Environment):
    tools = (ToolSpec("read", "show the colour of card i", {"type": "object", "properties":
                      {"i": {"type": "integer"}}, "required": ["i"]}),
             ToolSpec("finish", "submit the red card", {"type": "object", "properties":
                      {"answer": {"type": "integer"}}, "required": ["answer"]}))

    def reset(self, task):
        self.task = task
        return Reset(f"There are {task['cards']} cards, numbered from 0, and one is red. Read "
                     "them one per turn with read(i), then finish with the red card's number.",
                     list(self.tools))

    def step(self, name, args):
        if name == "finish":
            return StepResult("done", done=True, reward=float(args["answer"] == self.task["red"]))
        if not 0 <= args["i"] < self.task["cards"]:
            return StepResult(f"There is no card {args['i']}.")
        return StepResult(f"card {args['i']} is {'red' if args['i'] == self.task['red'] else 'blue'}.")

# Optional: a scripted expert, for SFT demonstrations and `supo-jax rollout --policy scripted`.
class CardsExpert(StateExpert):
    def start(self, prompt):              # the state before any call
        return {"next": 0, "red": -1}

    def update(self, state, observation):  # after each tool observation
        m = re.fullmatch(r"card (\d+) is (red|blue)\.", observation)
        if m and int(m[1]) == state["next"]:
            return {"next": state["next"] + 1, "red": int(m[1]) if m[2] == "red" else -1}
        return state

    def decide(self, state):              # (thought, tool, arguments)
        if state["red"] >= 0:
            return "Found it.", "finish", {"answer": state["red"]}
        return f"Next card {state['next']}.", "read", {"i": state["next"]}

register_expert("cards", CardsExpert)
