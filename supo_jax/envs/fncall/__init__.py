"""Function-calling suite in the spirit of CodeGym (docs/SUPO.md §8).

Procedurally generated families whose solution takes ~n atomic tool calls (one per
turn) and a loop state carried across them. Observations are a few dozen characters,
so a horizon of n steps overflows a working context of about n*40 tokens and the
agent must summarize its loop state to finish. Reward: 1.0 for the exact answer via
finish(answer), else 0.0.

family    tools                      answer                       loop state (summary keys)
tallest   compare(i, j)              index of the tallest person  best=<index>; next=<index>
pages     read_page(page)            sum of the n page numbers    sum=<int>; next=<page>
chain     lookup(key)                key reached after n hops     key=<key>; hops=<int>
graph     neighbors(node)            BFS distance source->target  layer=<int>; todo=[..];
                                                                  next_layer=[..]; seen=[..]
count     look(i)                    red items of a hidden-length count=<int>; next=<index>;
                                     row                          last=<index or -1>
listing   read_page(page)            one key's value in n pages   next=<page>; value=<int or -1>
                                     of 4 entries
reports   read_report(report)        sum of the figures of n      sum=<int>; next=<report>
                                     reports (~100-200 tokens
                                     each, the figure first)
records   look(i)                    count's answer; each record  count's
                                     ~100-200 tokens, the colour
                                     first
sections  read_page(section, page)   largest total of n sections  best=<int>; section=<int>;
                                     of 6 pages                   sum=<int>; page=<int>

The knob n is: people / pages / hops / nodes / items / pages / reports / items / sections.
`fncall` (the mixture) draws from the first four; the others run as `fncall/<family>`.
reports, records and sections are for comparing context managers: a report or a record is
dead weight once read (clearing old results, folding or summarizing reaches far, `full` does
not; records keeps count's running tally, a small policy's answer, where reports sums), and
a section is a sub-task whose pages can be dropped once it is summed (under fold the expert
opens a branch a section; the default 8 sections use context.max_branches' 8). For "graph" the state is the BFS state
(nodes expanded layer by layer in ascending order; `seen` lists every node found),
about 3n tokens, so keep n <= ~40 there; the target is a node farthest from the source,
so the search expands most of the graph.

Canonical state and probe: each env computes, from the calls the agent has made so far,
the state of the family's canonical algorithm (linear scan / prefix read / chain walk /
BFS) that those calls have completed (e.g. tallest: next = smallest person never
compared except 0, best = tallest among the people compared). `probe(summary)` is True
iff the summary states every key, each key with a single value, and the values equal the
canonical state after the last or the second-to-last `act` (SUPO drops the overflowing
action from the summarizer's context, though the env ran it). Keys are matched
case-insensitively as `key=value` or `key: value`; list values are sets of ints.

`expert_for(env_name)` returns a scripted Expert that plays the canonical algorithm from
the working context alone (prompt, latest summary, observations after it).

Modules: common.py (FncallEnv, the base every family subclasses, and shared helpers), one
file per family (tallest.py, pages.py, chain.py, graph.py, count.py, listing.py, reports.py,
records.py, sections.py), suite.py
(FAMILY_ENVS, the `fncall` mixture env, generate_tasks), expert.py (Expert, expert_for).
Importing this package registers `fncall`, each `fncall/<family>` and the expert.
"""
from __future__ import annotations

from functools import partial

from supo_jax.envs.base import register_env
from supo_jax.envs.experts import register_expert
from supo_jax.envs.fncall.chain import Chain
from supo_jax.envs.fncall.common import FncallEnv, format_state
from supo_jax.envs.fncall.count import Count
from supo_jax.envs.fncall.expert import Expert, expert_for
from supo_jax.envs.fncall.graph import Graph
from supo_jax.envs.fncall.listing import Listing
from supo_jax.envs.fncall.pages import Pages
from supo_jax.envs.fncall.records import Records
from supo_jax.envs.fncall.reports import Reports
from supo_jax.envs.fncall.sections import Sections
from supo_jax.envs.fncall.suite import FAMILIES, FAMILY_ENVS, Fncall, generate_tasks
from supo_jax.envs.fncall.tallest import Tallest

__all__ = ["FAMILIES", "FAMILY_ENVS", "Chain", "Count", "Expert", "Fncall", "FncallEnv", "Graph",
           "Listing", "Pages", "Records", "Reports", "Sections", "Tallest", "expert_for", "format_state",
           "generate_tasks"]

register_env("fncall", tasks=generate_tasks)(Fncall)
for _f, _cls in FAMILY_ENVS.items():
    register_env(f"fncall/{_f}", tasks=partial(generate_tasks, families=(_f,),
                                               _stream=f"fncall/{_f}"))(_cls)
register_expert("fncall", expert_for, prefix=True)
