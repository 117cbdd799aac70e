"""docs/ENVIRONMENTS.md's complete example of an environment of your own and its scripted
expert (the page shows this file: experiments/update_docs.py). From the repository root:
supo-jax train --set 'env.imports=["my_envs.redcount"]' --set env.name=redcount"""
import random
import re

from supo_jax.envs.base import Environment, Reset, StepResult, ToolSpec, register_env
from supo_jax.envs.experts import StateExpert, register_expert

def tasks(split, n, seed=0, size=12):
    rng = random.Random(f"{split}:{seed}")   # train and eval: disjoint streams
    out = []
    for i in range(n):
        cards = size + i % 4
        out.append({"task_id": f"redcount:{split}:{seed}:{i}", "family": "redcount",
                    "cards": cards, "red": [rng.random() < 0.3 for _ in range(cards)]})
    return out

@register_env("redcount", tasks=tasks)
class RedCount(Environment):
    tools = (ToolSpec("read", "show the colour of card i", {"type": "object", "properties":
                      {"i": {"type": "integer"}}, "required": ["i"]}),
             ToolSpec("finish", "submit how many cards are red", {"type": "object",
                      "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}))

    def reset(self, task):
        self.task, self.seen = task, set()
        return Reset(f"There are {task['cards']} cards, numbered from 0. Read them one per turn "
                     "with read(i), then finish with how many are red.", list(self.tools))

    def step(self, name, args):
        if name == "finish":   # a right count without reading every card is a guess: no reward
            right = args["answer"] == sum(self.task["red"]) and len(self.seen) == self.task["cards"]
            return StepResult("done", done=True, reward=float(right))
        if not 0 <= args["i"] < self.task["cards"]:
            return StepResult(f"There is no card {args['i']}.")
        self.seen.add(args["i"])
        return StepResult(f"card {args['i']} is {'red' if self.task['red'][args['i']] else 'blue'}.")

# Optional: a scripted expert, for SFT demonstrations and `supo-jax rollout --policy scripted`.
class RedCountExpert(StateExpert):
    def start(self, prompt):              # the state before any call
        return {"cards": int(re.search(r"There are (\d+) cards", prompt)[1]), "next": 0, "red": 0}

    def update(self, state, observation):  # after each tool observation
        m = re.fullmatch(r"card (\d+) is (red|blue)\.", observation)
        if m and int(m[1]) == state["next"]:
            return {**state, "next": state["next"] + 1, "red": state["red"] + (m[2] == "red")}
        return state

    def decide(self, state):              # (thought, tool, arguments)
        if state["next"] == state["cards"]:
            return f"{state['red']} red of {state['cards']}.", "finish", {"answer": state["red"]}
        return f"{state['red']} red so far. Next card {state['next']}.", "read", {"i": state["next"]}

register_expert("redcount", RedCountExpert)
