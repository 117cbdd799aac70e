"""A verifiers environment as an out-of-process harness of a run (docs/HARNESS.md, "A verifiers
environment"): it claims the run's sessions (GET /sessions/next), plays each one as a verifiers
episode of the session's task, its model client pointed at the session's base URL, and
reports the reward verifiers' scoring gave the trace (POST /sessions/{id}/reward).

    python supo_jax/harnesses/verifiers_bridge.py URL MODULE:FUNCTION [--workers N] [--log F]

Run by the verifiers virtual environment's python (supo_jax.harnesses.verifiers_venv), as a
script: it imports nothing of supo_jax itself (the environment's module may). MODULE:FUNCTION
returns a `verifiers.v1.Env` whose taskset has `task_for(task_dict)` (a vf.Task of the
session's task). The trainer starts it (env.harness="verifiers:MODULE:FUNCTION") once its
sessions server is up and stops it at the end.

An episode that fails in verifiers (an error on its trace, the harness raising) becomes a
failed rollout, never a crash: the bridge posts `{"reward": null, "error": ...}`, which the
server answers with 400 invalid_reward and fails that rollout (env_error). A session the
server ended (an H or S cap, the context limit) needs no reward. `--log F` appends a JSON
line per session: its id, task id, the reward posted (null: failed), verifiers' rewards.
"""
import argparse
import asyncio
import importlib
import json
import math
import os
import sys
import time
import traceback


def load(spec: str):
    """The environment MODULE:FUNCTION returns (the working directory on the path)."""
    mod, sep, fn = spec.partition(":")
    if not (sep and mod and fn):
        raise SystemExit(f"verifiers bridge: MODULE:FUNCTION expected, got {spec!r}")
    sys.path.insert(0, os.getcwd())
    return getattr(importlib.import_module(mod), fn)()


async def episode(env, session: dict):
    """(reward or None, verifiers' rewards, error text) of one verifiers episode of the
    session's task, its model calls sent to the session."""
    import verifiers.v1 as vf

    ctx = vf.ModelContext(model=session["model"], client=vf.EvalClientConfig(
        base_url=session["base_url"], api_key_var="SUPO_VERIFIERS_BRIDGE_KEY"))
    task = env.taskset.task_for(session["task"])
    ep = await env.run_episode(task, ctx)
    if not ep.traces or not ep.ok:
        errors = [e for t in ep.traces for e in t.errors] + list(ep.errors)
        return None, {}, "; ".join(f"{e.type}: {e.message}" for e in errors)[:400] or (
            "the verifiers episode failed")
    trace = ep.traces[0]
    rewards = {k: (None if v is None else v.value) for k, v in trace.rewards.items()}
    return float(trace.reward), rewards, ""


async def worker(env, http, url: str, log):
    while True:
        try:
            r = await http.get(f"{url}/sessions/next", params={"wait": 30}, timeout=60)
        except Exception:   # noqa: BLE001 - the server is not up (yet, or again)
            await asyncio.sleep(0.2)
            continue
        if r.status_code != 200:
            await asyncio.sleep(0.2 if r.status_code != 204 else 0)
            continue
        session = r.json()
        started = time.monotonic()
        try:
            reward, rewards, error = await episode(env, session)
        except Exception as e:  # noqa: BLE001 - a failed rollout, not a crash
            reward, rewards, error = None, {}, f"{type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
        if reward is not None and not math.isfinite(reward):
            reward, error = None, f"verifiers scored {reward}"
        body = {"reward": reward} if reward is not None else {"reward": None,
                                                              "error": error[:400]}
        try:
            posted = await http.post(f"{url}/sessions/{session['id']}/reward", json=body)
            status = posted.status_code
        except Exception as e:  # noqa: BLE001
            status = f"{type(e).__name__}"
        line = {"session": session["id"], "task_id": session["task"].get("task_id"),
                "reward": reward, "rewards": rewards, "error": error or None,
                "status": status, "seconds": round(time.monotonic() - started, 3)}
        if log:
            with open(log, "a") as f:
                f.write(json.dumps(line) + "\n")


async def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="the run's sessions server, http://127.0.0.1:PORT")
    p.add_argument("environment", help="MODULE:FUNCTION returning a verifiers.v1 Env")
    p.add_argument("--workers", type=int, default=8, help="sessions played at once")
    p.add_argument("--log", default="", help="a JSON line per session, appended")
    a = p.parse_args(argv)
    import httpx

    env = load(a.environment)
    async with env.serving(), httpx.AsyncClient(timeout=None) as http:
        print(f"verifiers bridge: {a.environment} claims {a.url}/sessions/next", flush=True)
        await asyncio.gather(*(worker(env, http, a.url.rstrip("/"), a.log)
                               for _ in range(a.workers)))


if __name__ == "__main__":
    asyncio.run(main())
