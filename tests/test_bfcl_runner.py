"""BFCL's own runner and scorer against `supo-jax serve`, task for task with our bfcl/* envs.

bfcl-eval's `bfcl generate` (its local-server mode: --skip-server-setup, its Qwen3 FC handler
formatting its own ChatML prompts for /v1/completions, parsing the `<tool_call>` blocks of the
replies, executing them in its own simulators) drives our endpoint serving a scripted policy
(supo_jax.serve.scripted: the bfcl/* environments' expert, which replays BFCL's ground truth),
and `bfcl evaluate` scores the results. The same policies run in our environments: the
ground truth, which both must pass, and the ground truth with one call dropped, which both
must judge alike task by task. bfcl-eval is installed as the README says (--no-deps); its
command's imports of other vendors' SDKs are stubbed in its own processes
(tests/bfcl_stubs/sitecustomize.py).

The sample: tasks of every multi-turn category whose first question is no other task's (one
served policy answers them all and must tell them apart from the prompt alone).
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("bfcl_eval")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUBS = os.path.join(ROOT, "tests", "bfcl_stubs")
MODEL = "Qwen/Qwen3-0.6B-FC"          # a local model of BFCL's: its Qwen FC handler
SAMPLE = {"base": ["multi_turn_base_154", "multi_turn_base_187"],
          "long_context": ["multi_turn_long_context_151"],
          "miss_func": ["multi_turn_miss_func_2", "multi_turn_miss_func_3"],
          "miss_param": ["multi_turn_miss_param_2", "multi_turn_miss_param_11"]}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bfcl", path=os.path.dirname(sys.executable))
                                 is None, reason="bfcl-eval's `bfcl` command is not installed")]


class SampleExpert:
    """The bfcl/<category> expert of the sample task whose first question opens the chat."""

    def __init__(self):
        from supo_jax.envs.bfcl.data import entries
        from supo_jax.envs.bfcl.environment import BFCLExpert, _question

        self.by_question = {}
        for category, ids in SAMPLE.items():
            for i in ids:
                q = _question(entries(category)[i]["question"][0])
                assert q not in self.by_question, (i, "a first question seen twice")
                self.by_question[q] = BFCLExpert(category)

    def act(self, messages, summarize=False):
        first = next(m["content"] for m in messages if m["role"] == "user")
        if first not in self.by_question:
            raise ValueError(f"not a sample task: {first[:80]!r}")
        return self.by_question[first].act(messages, summarize)


class DroppingExpert:
    """`inner`, less the last tool call of the chat's first action that makes calls (that
    action becomes a plain reply when it made one call only): a policy that misses a call."""

    def __init__(self, inner):
        self.inner = inner

    def act(self, messages, summarize=False):
        reply = self.inner.act(messages, summarize)
        if summarize or any("<tool_call>" in m["content"] for m in messages
                            if m["role"] == "assistant"):
            return reply
        calls = list(re.finditer(r"<tool_call>.*?</tool_call>", reply, re.S))
        if not calls:
            return reply
        last = calls[-1]
        left = (reply[:last.start()] + reply[last.end():]).strip()
        return left or "I cannot do that."


def _tokenizer_dir(path):
    """What BFCL's handler loads from --local-model-path: the tokenizer (its chat template
    unused: the handler formats its own prompts) and a config.json giving the context."""
    from supo_jax.model.tiny import tiny_tokenizer

    tok = tiny_tokenizer(out_dir=str(path))
    with open(path / "config.json", "w") as f:
        json.dump({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                   "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "max_position_embeddings": 1 << 20}, f)
    return tok


def _bfcl(args, root, port=None):
    env = dict(os.environ, BFCL_PROJECT_ROOT=str(root), PYTHONPATH=STUBS,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if port is not None:
        env.update(LOCAL_SERVER_ENDPOINT="127.0.0.1", LOCAL_SERVER_PORT=str(port))
    r = subprocess.run(["bfcl", *args], env=env, capture_output=True, text=True, timeout=600,
                       cwd=root)
    assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-3000:])
    return r


def _bfcl_verdicts(expert, tok, tok_dir, root):
    """{task id: BFCL's verdict} of `expert` served by `supo-jax serve`'s app (scripted
    engine), run and scored by BFCL's own commands."""
    from supo_jax.agent.render import ChatFormat
    from supo_jax.serve.app import Running, Server, build_app
    from supo_jax.serve.scripted import ScriptedEngine

    fmt = ChatFormat(tok)
    engine = ScriptedEngine(expert, fmt, 1 << 20)
    running = Running(build_app(Server(engine, fmt, str(tok_dir))))
    root.mkdir()
    try:
        with open(root / "test_case_ids_to_generate.json", "w") as f:
            json.dump({f"multi_turn_{c}": ids for c, ids in SAMPLE.items()}, f)
        port = int(running.url.rsplit(":", 1)[1].split("/")[0])
        _bfcl(["generate", "--model", MODEL, "--test-category", "multi_turn",
               "--skip-server-setup", "--local-model-path", str(tok_dir), "--num-threads", "2",
               "--run-ids"], root, port)
    finally:
        running.stop()
        engine.close()
    assert engine.failed == 0 and engine.answered >= 20, (engine.failed, engine.answered)
    _bfcl(["evaluate", "--model", MODEL, "--test-category", "multi_turn", "--partial-eval"],
          root)
    verdicts = {}
    for category, ids in SAMPLE.items():
        path = root / "score" / MODEL.replace("/", "_") / "multi_turn" / \
            f"BFCL_v4_multi_turn_{category}_score.json"
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        assert lines[0]["total_count"] == len(ids), lines[0]
        failed = {x["id"] for x in lines[1:]}
        verdicts.update({i: i not in failed for i in ids})
    return verdicts


def _our_verdicts(expert, tok):
    """{task id: reward == 1} of `expert` through our bfcl/<category> environments."""
    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts
    from supo_jax.envs import make_env

    fmt = ChatFormat(tok)
    cfg = ContextConfig(manager="full", working_context=1_000_000, max_steps=400,
                        max_action_tokens=8192, max_observation_tokens=1_000_000,
                        trigger_rule="paper")
    out = {}
    for category, ids in SAMPLE.items():
        name = f"bfcl/{category}"
        tasks = [{"task_id": i, "family": name, "category": category} for i in ids]
        for r in run_rollouts(ScriptedActor(expert, fmt), lambda: make_env(name), tasks, fmt,
                              cfg, rows=len(ids)):
            assert r.reason in ("answer", "max_steps"), (r.task_id, r.reason)
            out[r.task_id] = r.reward == 1.0
    return out


def test_bfcls_runner_and_scorer_agree_with_our_environments_task_for_task(tmp_path):
    tok_dir = tmp_path / "model"
    tok_dir.mkdir()
    tok = _tokenizer_dir(tok_dir)
    truth = SampleExpert()
    for name, expert in [("truth", truth), ("drop", DroppingExpert(truth))]:
        theirs = _bfcl_verdicts(expert, tok, tok_dir, tmp_path / name)
        ours = _our_verdicts(expert, tok)
        assert theirs == ours, (name, theirs, ours)
        if name == "truth":
            assert all(theirs.values()), theirs
        else:      # a missed call fails the task, whichever its category
            assert not any(theirs.values()), theirs
