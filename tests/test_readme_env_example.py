"""The README's one-file environment example works as written."""
import os
import re
import sys

from supo_jax.agent.context import ContextConfig
from supo_jax.agent.render import ChatFormat
from supo_jax.agent.rollout import ScriptedActor, run_rollouts
from supo_jax.config import Config, apply_overrides
from supo_jax.envs import make_env, make_tasks
from supo_jax.model.tiny import tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_environment_example(tmp_path, monkeypatch):
    readme = open(os.path.join(ROOT, "README.md")).read()
    code = re.search(r"```python\n# my_envs/counter.py\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "my_envs").mkdir()
    (tmp_path / "my_envs" / "__init__.py").write_text("")
    (tmp_path / "my_envs" / "counter.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    from supo_jax.envs import base
    monkeypatch.setattr(base, "_ENVS", dict(base._ENVS))   # the example's registration is undone
    cfg = apply_overrides(Config(), ['env.imports=["my_envs.counter"]', "env.name=counter"])
    assert cfg.env.name == "counter"

    class Counter:  # a scripted policy that counts its own tool results
        def act(self, messages, summarize):
            done = sum(m["role"] == "tool" for m in messages)
            n = int(re.search(r"exactly (\d+) times", messages[0]["content"]).group(1))
            name, args = ("finish", {"answer": n}) if done == n else ("inc", {})
            import json
            return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'

    fmt = ChatFormat(tiny_tokenizer())
    tasks = make_tasks("counter", "train", 3)
    ro = run_rollouts(ScriptedActor(Counter(), fmt), lambda: make_env("counter"), tasks, fmt,
                      ContextConfig("full", 4000, max_steps=30))
    assert [r.reward for r in ro] == [1.0, 1.0, 1.0]
    sys.modules.pop("my_envs.counter", None)
    sys.modules.pop("my_envs", None)
