"""Serving: output tokens/s through the OpenAI endpoint against the sampler itself, time to
first token, and a conversation's prefix reuse against re-prefill.

A random tiny policy (qwen2 family, float32; default hidden 256, 4 layers) behind
`supo-jax serve`'s app (supo_jax.serve: Engine, Starlette on uvicorn in this process), and
clients in a process of their own (asyncio, aiohttp, spawned once), as a server's clients
are: their parsing does not contend for the server's interpreter lock. aiohttp, as vLLM's
serving benchmark: httpx.AsyncClient's connection pool costs about 3.7 ms a request at 32
concurrent connections on this machine (32 GETs of /health: 114 ms vs aiohttp's 33), which
made the client, not the server, the bottleneck at 32 clients.

  throughput   the same --requests prompts (random text, about --prompt tokens each) at 1,
               8 and 32 concurrent clients, each client sending streamed greedy
               /v1/completions requests (token ids in, `return_token_ids`) one after
               another, --new tokens at most (the chat format's stop tokens end one
               earlier); output tokens/s = tokens returned / wall seconds. Against the
               same prompts decoded by the sampler directly: a Sampler of as many rows as
               clients, a prompt starting in each row as it frees (Sampler.start / advance,
               the rollouts' streaming rows and their greedy path), with no HTTP. Ratio =
               endpoint / sampler, per round. The engine has as many rows as the most
               clients (32) at every level; its decode chunk is the server's (16 tokens).
  TTFT         each streamed request's seconds from sending to its first token (a token
               comes with the decode call that sampled it: up to 16 steps after the prompt's
               prefill), at 1 and 32 clients.
  conversation --turns turns of one conversation through /v1/completions: turn k's prompt is
               turn k-1's prompt + its completion + a new user message (--message tokens),
               after a --system-token system prompt; --new tokens per turn, greedy. With
               prefix reuse (the engine's default: the row keeps its cache and prefills
               what is new) against a server whose reuse is off (Engine(reuse_prefix=
               False): every turn prefills its whole prompt). Ratios: prefilled tokens and
               wall seconds, re-prefill / reuse. A fresh server per run, so no run reuses
               another's rows.

The first run of each shape compiles: one untimed round of everything first, then
--repeats rounds alternating endpoint and sampler (reuse and re-prefill); the seconds jax
reports compiling within a timed run (a new subset of rows or attention span) are
subtracted from it and reported. Greedy both ways: the endpoint must return the sampler's
own tokens ("same tokens"; float rounding of another batch could flip a near-tie).

    python benchmarks/serve.py            # writes benchmarks/results/serve.json
"""
from __future__ import annotations

import json
import random
import time

import common

TARGET, TARGET_CLIENTS = 0.8, 32
DECODE_CHUNK = 16
WORDS = ("the river map stone quick answer light table seven orange garden north tool "
         "window paper simple number blue market under water field report travel").split()


def _text_ids(fmt, rs: random.Random, n: int) -> list[int]:
    """About n tokens of random words (their encoding, cut to n)."""
    ids: list[int] = []
    while len(ids) < n:
        ids += fmt.encode(" ".join(rs.choice(WORDS) for _ in range(n)))
    return ids[:n]


def _prompts(fmt, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rs = random.Random(seed)
    return [_text_ids(fmt, rs, rs.randint(length * 3 // 4, length * 5 // 4)) for _ in range(count)]


class Timed:
    """A block's wall seconds less the seconds jax spent compiling within it."""

    def __enter__(self):
        self.c0, self.t0 = common.COMPILE_S[0], time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.compile_s = common.COMPILE_S[0] - self.c0
        self.seconds = time.perf_counter() - self.t0 - self.compile_s


async def _stream(h, url: str, prompt: list[int], new: int) -> tuple[list[int], float]:
    """One streamed greedy completion (`h` an aiohttp session): (its token ids, seconds to
    the first of them)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": new, "temperature": 0,
            "stream": True, "return_token_ids": True}
    ids, first, t0 = [], None, time.perf_counter()
    async with h.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:                    # the SSE stream, line by line
            line = raw.decode()
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                if c.get("token_ids"):
                    first = first if first is not None else time.perf_counter() - t0
                    ids += c["token_ids"]
    return ids, first


async def _clients(url: str, prompts, clients: int, new: int) -> dict:
    """`clients` concurrent clients sending the prompts (taken in order from a shared list)
    as streamed requests, one after another each: their tokens, each request's time to
    first token, and the wall seconds from the first request to the last response."""
    import asyncio

    import aiohttp

    todo, out, ttft = list(enumerate(prompts)), {}, {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients),
                                     timeout=aiohttp.ClientTimeout(total=600)) as h:
        async def client():
            while todo:
                i, p = todo.pop(0)
                out[i], ttft[i] = await _stream(h, url, p, new)
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": [out[i] for i in range(len(prompts))],
            "ttft": [ttft[i] for i in range(len(prompts))]}


def _client_main(conn) -> None:
    """The client process: runs each (url, prompts, clients, new) it receives, sends back
    the result; None ends it."""
    import asyncio

    while (job := conn.recv()) is not None:
        conn.send(asyncio.run(_clients(*job)))


class Clients:
    """HTTP clients in a process of their own (spawned once), as a server's clients are:
    their threads and parsing do not share the server's interpreter lock."""

    def __init__(self):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_client_main, args=(child,), daemon=True)
        self.proc.start()

    def run(self, url: str, prompts, clients: int, new: int) -> dict:
        """`_clients`' figures; the seconds jax compiled in this process (the server's)
        meanwhile are subtracted from the clients' wall seconds."""
        c0 = common.COMPILE_S[0]
        self.conn.send((url, prompts, clients, new))
        out = self.conn.recv()
        out["compile_s"] = common.COMPILE_S[0] - c0
        out["seconds"] -= out["compile_s"]
        return out

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=30)


def sampler_run(sampler, prompts, new: int, stops) -> dict:
    """The prompts through `sampler`'s rows directly: each starts in a row as one frees
    (Sampler.start / advance), greedy, compiled setting (the rollouts' path)."""
    import jax

    from supo_jax.sampling.sampler import SamplingParams

    greedy, rng = SamplingParams(temperature=0.0), jax.random.key(0)
    todo, free, of, out = list(enumerate(prompts)), list(range(sampler.batch)), {}, {}
    with Timed() as t:
        while todo or sampler.generating:
            starting = {}
            while free and todo:
                r = free.pop(0)
                of[r], starting[r] = todo.pop(0)
                sampler.reset(r, 0)
            if starting:
                sampler.append(starting)
                sampler.start(list(starting), new, stops)
            for r, g in sampler.advance(greedy, rng).items():
                out[of[r]] = g.tokens
                free.append(r)
    return {"seconds": t.seconds, "compile_s": t.compile_s,
            "tokens": [out[i] for i in range(len(prompts))]}


def conversation_run(policy, fmt, rows: int, max_len: int, system, messages, new: int,
                     reuse: bool) -> dict:
    """One conversation's turns through a fresh server (prefix reuse on or off): the wall
    seconds of its requests, the tokens its engine prefilled and kept, its completions."""
    import httpx

    from supo_jax.serve.app import Running, Server, build_app
    from supo_jax.serve.engine import Engine

    engine = Engine(policy, rows=rows, max_len=max_len, decode_chunk=DECODE_CHUNK,
                    reuse_prefix=reuse)
    server = Running(build_app(Server(engine, fmt, "tiny")))
    try:
        prompt, out = list(system) + messages[0], []
        with httpx.Client(base_url=server.url, timeout=600) as h, Timed() as t:
            for k in range(len(messages)):
                r = h.post("/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": new, "temperature": 0,
                    "return_token_ids": True})
                r.raise_for_status()
                ids = r.json()["choices"][0]["token_ids"]
                out.append(ids)
                if k + 1 < len(messages):
                    prompt = prompt + ids + messages[k + 1]
        return {"seconds": t.seconds, "compile_s": t.compile_s, "prefilled": engine.prefilled,
                "reused": engine.reused, "tokens": out, "last_prompt": len(prompt)}
    finally:
        server.stop()
        engine.close()


def _conversation(fmt, seed: int, system: int, message: int, turns: int):
    rs = random.Random(1000 + seed)
    return _text_ids(fmt, rs, system), [
        fmt.encode("\nuser: ") + _text_ids(fmt, rs, message) + fmt.encode("\nassistant:")
        for _ in range(turns)]


def main(argv=None):
    ap = common.parser(__doc__)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--clients", default="1,8,32", help="concurrency levels (comma-separated)")
    ap.add_argument("--requests", type=int, default=64, help="prompts per level (the same at each)")
    ap.add_argument("--prompt", type=int, default=48, help="prompt tokens (about)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per request (at most)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system", type=int, default=256,
                    help="the conversation's system prompt tokens")
    ap.add_argument("--message", type=int, default=24, help="tokens of each user message")
    ap.add_argument("--turn-new", type=int, default=32, help="new tokens per conversation turn")
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.clients, args.requests = 32, 1, "1,4", 4
        args.prompt, args.new, args.turns, args.turn_new = 16, 8, 3, 8
        args.system, args.message = 16, 8        # the conversation fits the same cache shape
    repeats = args.repeats or (1 if args.smoke else 3)
    clients = [int(c) for c in args.clients.split(",")]
    run = common.Run("serve", args, argv)
    common.count_compiles()

    from supo_jax.agent.render import ChatFormat
    from supo_jax.sampling.sampler import Sampler, bucket
    from supo_jax.serve.app import Running, Server, build_app
    from supo_jax.serve.engine import Engine

    policy, _ = common.tiny_policy(args.hidden, args.layers, smoke=args.smoke)
    fmt = ChatFormat(policy.tokenizer)
    mc = policy.config
    prompts = _prompts(fmt, args.requests, args.prompt)
    rows = max(clients)
    max_len = bucket(max(map(len, prompts)) + args.new, 128)
    print(f"policy: {mc.num_params / 1e6:.2f}M parameters (hidden {mc.hidden_size}, "
          f"{mc.num_layers} layers); {args.requests} prompts of ~{args.prompt} tokens, "
          f"{args.new} new tokens; engine {rows} rows of {max_len} tokens", flush=True)

    engine = Engine(policy, rows=rows, max_len=max_len, decode_chunk=DECODE_CHUNK)
    server = Running(build_app(Server(engine, fmt, "tiny")))
    clients_proc = Clients()
    samplers = {c: Sampler(policy, c, max_len, decode_chunk=DECODE_CHUNK) for c in clients}
    stops = set(fmt.stop_ids)
    levels = []
    try:
        for c in clients:
            clients_proc.run(server.url, prompts, c, args.new)          # compiling rounds
            sampler_run(samplers[c], prompts, args.new, stops)
            ep, sa = [], []
            for i in range(repeats):
                ep.append(clients_proc.run(server.url, prompts, c, args.new))
                sa.append(sampler_run(samplers[c], prompts, args.new, stops))
                n = sum(map(len, ep[-1]["tokens"]))
                print(f"{c:3d} clients, round {i + 1}: endpoint {n / ep[-1]['seconds']:.0f} "
                      f"tokens/s, sampler {n / sa[-1]['seconds']:.0f} tokens/s", flush=True)
            levels.append(_level(c, ep, sa))
    finally:
        clients_proc.close()
        server.stop()
        engine.close()
    for x in levels:
        print(f"{x['clients']:3d} clients: endpoint / sampler tokens/s "
              f"{x['ratio']['median']:.2f}x; "
              f"time to first token median {x['ttft_s']['median'] * 1e3:.0f} ms; same tokens: "
              f"{x['same_tokens']}", flush=True)

    conv = _conversations(policy, fmt, args, repeats, min(4, rows), max_len)
    print(f"conversation ({args.turns} turns): prefilled tokens re-prefill / reuse "
          f"{conv['prefill_ratio']:.2f}x; wall time {conv['time_ratio']['median']:.2f}x; "
          f"same tokens: {conv['same_tokens']}", flush=True)

    top = next((x for x in levels if x["clients"] == TARGET_CLIENTS), levels[-1])
    results = {
        "throughput": levels,
        "ttft": {str(x["clients"]): x["ttft_s"] for x in levels if x["clients"] in (1, rows)},
        "conversation": conv,
        "targets": [{"what": f"endpoint output tokens/s at {top['clients']} clients vs the "
                             "sampler itself (CPU)", "target": f">= {TARGET:g}x",
                     "measured": f"{top['ratio']['median']:.2f}x",
                     "met": top["ratio"]["median"] >= TARGET}],
    }
    config = {"requests": args.requests, "prompt_tokens": args.prompt, "new_tokens": args.new,
              "clients": clients, "engine_rows": rows, "max_len": max_len,
              "decode_chunk": DECODE_CHUNK, "repeats": repeats, "sampling": "greedy",
              "conversation": {"turns": args.turns, "system_tokens": args.system,
                               "message_tokens": args.message, "new_tokens": args.turn_new},
              "model": {"params": mc.num_params, "hidden": mc.hidden_size,
                        "layers": mc.num_layers, "heads": mc.num_heads,
                        "kv_heads": mc.num_kv_heads, "mlp": mc.intermediate_size,
                        "vocab": mc.vocab_size, "dtype": "float32"}}
    run.write(results, config=config)


def _level(clients: int, ep: list[dict], sa: list[dict]) -> dict:
    """One concurrency level's figures from its timed rounds (endpoint and sampler)."""
    tps = lambda r: sum(map(len, r["tokens"])) / r["seconds"]
    return {"clients": clients,
            "endpoint_tokens_per_s": common.stats(map(tps, ep)),
            "sampler_tokens_per_s": common.stats(map(tps, sa)),
            "ratio": common.stats(tps(e) / tps(s) for e, s in zip(ep, sa)),
            "ttft_s": common.stats(t for r in ep for t in r["ttft"]),
            "tokens": sum(map(len, ep[-1]["tokens"])),
            "compile_s": sum(r["compile_s"] for r in ep + sa),
            "same_tokens": all(e["tokens"] == s["tokens"] for e, s in zip(ep, sa)),
            "same_tokens_share": sum(a == b for a, b in zip(ep[-1]["tokens"], sa[-1]["tokens"]))
            / len(sa[-1]["tokens"])}


def _conversations(policy, fmt, args, repeats: int, rows: int, min_len: int) -> dict:
    """The conversation with prefix reuse and with re-prefill on servers of `rows` rows of
    at least `min_len` tokens: one untimed pair, then `repeats` alternating pairs, a
    distinct conversation per pair (so no server could reuse another's prompt even if it
    kept its rows)."""
    from supo_jax.sampling.sampler import bucket

    def pair(seed):
        system, messages = _conversation(fmt, seed, args.system, args.message, args.turns)
        need = len(system) + sum(map(len, messages)) + args.turns * args.turn_new
        return {v: conversation_run(policy, fmt, rows, bucket(need, min_len), system,
                                    messages, args.turn_new, reuse=v == "reuse")
                for v in ("reuse", "reprefill")}

    pair(0)
    runs = [pair(i + 1) for i in range(repeats)]
    for i, p in enumerate(runs):
        print(f"conversation round {i + 1}: reuse {p['reuse']['seconds']:.2f} s "
              f"({p['reuse']['prefilled']} prefilled), "
              f"re-prefill {p['reprefill']['seconds']:.2f} s "
              f"({p['reprefill']['prefilled']} prefilled)", flush=True)
    last = runs[-1]
    out = {v: {"seconds": common.stats(p[v]["seconds"] for p in runs),
               "prefilled_tokens": last[v]["prefilled"], "reused_tokens": last[v]["reused"],
               "compile_s": sum(p[v]["compile_s"] for p in runs)}
           for v in ("reuse", "reprefill")}
    out.update(
        turns=args.turns, last_prompt_tokens=last["reuse"]["last_prompt"],
        prefill_ratio=last["reprefill"]["prefilled"] / max(1, last["reuse"]["prefilled"]),
        time_ratio=common.stats(p["reprefill"]["seconds"] / p["reuse"]["seconds"] for p in runs),
        same_tokens=all(p["reuse"]["tokens"] == p["reprefill"]["tokens"] for p in runs))
    return out


def limits(res: dict) -> str:
    """Why the throughput target is missed (empty when met)."""
    t = res["results"]["targets"][0]
    if t["met"]:
        return ""
    return (f"- **serve**: {t['measured']} of the sampler's own tokens/s through the endpoint "
            f"(target {t['target']}): a row whose request ended idles until its client's next "
            "request arrives and the next decode call begins (up to "
            f"{res['config']['decode_chunk']} steps later), where the sampler refills it at "
            "once; the HTTP layer's work (request checks, SSE events, the clients) shares the "
            "cores with the decode.\n")


def markdown(res: dict) -> str:
    c, r = res["config"], res["results"]
    m, conv, cc = c["model"], r["conversation"], c["conversation"]
    def rng(s, f="{:.0f}"):
        return f"{f.format(s['median'])} ({f.format(s['min'])}-{f.format(s['max'])})"
    rows = "\n".join(
        f"| {x['clients']} | {rng(x['endpoint_tokens_per_s'])} | {rng(x['sampler_tokens_per_s'])} "
        f"| **{x['ratio']['median']:.2f}x** ({x['ratio']['min']:.2f}-{x['ratio']['max']:.2f}) "
        f"| {x['ttft_s']['median'] * 1e3:.0f} ({x['ttft_s']['min'] * 1e3:.0f}-"
        f"{x['ttft_s']['max'] * 1e3:.0f}) | {x['tokens']} | {'yes' if x['same_tokens'] else 'no'} |"
        for x in r["throughput"])
    ru, rp = conv["reuse"], conv["reprefill"]
    return f"""Policy: random tiny qwen2 ({m['params'] / 1e6:.2f}M parameters: hidden {m['hidden']},
{m['layers']} layers, {m['heads']} heads / {m['kv_heads']} kv heads, MLP {m['mlp']}, vocab {m['vocab']}),
float32, greedy. `supo-jax serve`'s app on an in-process uvicorn, an engine of {c['engine_rows']}
rows of {c['max_len']} tokens (decode calls of {c['decode_chunk']} tokens); the clients run in a
process of their own (asyncio, aiohttp), streaming `/v1/completions` over HTTP, each sending
its requests one after another. {c['requests']} prompts of ~{c['prompt_tokens']} tokens, at most
{c['new_tokens']} new tokens each (the chat format's stop tokens end some sooner), the same
prompts at every level. The sampler column decodes them directly (a Sampler of as many rows
as clients, a prompt starting in each row as it frees; no HTTP). Median (min-max) of
{r['throughput'][0]['ratio']['n']} alternating rounds after one compiling round; seconds jax spent
compiling within a timed round are subtracted.

| clients | endpoint tokens/s | sampler tokens/s | endpoint / sampler | time to first token (ms) | tokens | same tokens |
|---|---|---|---|---|---|---|
{rows}

Time to first token counts from sending the request to the first streamed token; a token
comes with the decode call that sampled it (up to {c['decode_chunk']} steps after the prefill), and
a request that finds every row busy waits for one to free. Its maximum includes the
compiling of shapes first met in a timed round (not subtracted there).

Conversation: {conv['turns']} turns through `/v1/completions`, each turn's prompt the last
prompt + its completion + a new ~{cc['message_tokens']}-token user message, after a
{cc['system_tokens']}-token system prompt; {cc['new_tokens']} new tokens per turn (the last prompt:
{conv['last_prompt_tokens']} tokens). A fresh server per run; re-prefill is
`Engine(reuse_prefix=False)`.

| variant | seconds | prefilled tokens | tokens kept from the cache |
|---|---|---|---|
| prefix reuse (the default) | {rng(ru['seconds'], '{:.2f}')} | {ru['prefilled_tokens']} | {ru['reused_tokens']} |
| re-prefill every turn | {rng(rp['seconds'], '{:.2f}')} | {rp['prefilled_tokens']} | {rp['reused_tokens']} |

Prefilled tokens, re-prefill / reuse: **{conv['prefill_ratio']:.2f}x**; wall time, re-prefill /
reuse: **{conv['time_ratio']['median']:.2f}x** ({conv['time_ratio']['min']:.2f}-{conv['time_ratio']['max']:.2f}x);
the same completions: {'yes' if conv['same_tokens'] else 'no'}.
"""


if __name__ == "__main__":
    main()
