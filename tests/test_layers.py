"""The package's layering (docs/ARCHITECTURE.md): every import inside supo_jax, at module level
or inside a function, goes down or sideways in

    utils, text, hlo_cost, storage  ->  model  ->  sampling  ->  envs, harnesses  ->  agent  ->  rl, checkpoint, config, configs  ->  sweep, plan, serve  ->  cli

and no group of modules imports itself in a cycle. A new upward import fails here with the
line that made it."""
import ast
import re
import os

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "supo_jax")
LAYERS = [("utils", "text", "hlo_cost", "storage"), ("model",), ("sampling",), ("envs", "harnesses"), ("agent",),
          ("rl", "checkpoint", "config", "configs"), ("sweep", "plan", "serve"), ("cli", "__init__")]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(path: str, mods) -> list[tuple[str, int]]:
    """(imported supo_jax module, line) of every import statement in a file."""
    tree = ast.parse(open(path).read())
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # "from supo_jax.envs import fncall" imports the submodule when there is one
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                     else node.module for a in node.names]
        out += [(n, node.lineno) for n in names if n.startswith("supo_jax.") and n in mods]
    return out


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"   # supo_jax/__init__.py: the public API


def graph():
    mods = _modules()
    return {m: _imports(p, mods) for m, p in mods.items()}


def test_every_package_has_a_layer():
    assert {_layer(m) for m in graph()} <= set(RANK)


def test_no_upward_import():
    bad = [f"{m} (line {line}) imports {dep}" for m, deps in graph().items()
           for dep, line in deps if RANK[_layer(dep)] > RANK[_layer(m)]]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def find_cycles(g: dict[str, list[str]]) -> list[list[str]]:
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in g.get(m, ()):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    return cycles


def test_no_import_cycle():
    assert find_cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
    g = {m: sorted({d for d, _ in deps} - {m}) for m, deps in graph().items()}
    cycles = find_cycles(g)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_text_is_a_leaf_and_envs_never_import_the_agent_loop():
    g = graph()
    for m, deps in g.items():
        if _layer(m) == "text":
            assert all(_layer(d) == "text" for d, _ in deps), m
        if _layer(m) == "envs":
            assert not [d for d, _ in deps if _layer(d) == "agent"], m


@pytest.mark.parametrize("bad", ["supo_jax.rl.trainer"])
def test_the_walker_sees_function_level_imports(tmp_path, bad):
    src = tmp_path / "m.py"
    src.write_text(f"def f():\n    from {bad} import train\n")
    assert _imports(str(src), {bad}) == [(bad, 2)]


def test_architecture_doc_states_these_layers():
    doc = open(os.path.join(os.path.dirname(PKG), "docs", "ARCHITECTURE.md")).read()
    line = next(ln for ln in doc.splitlines() if ln.strip().startswith("layers:"))
    stated = [tuple(x.strip() for x in group.split(","))
              for group in line.split(":", 1)[1].split("->")]
    assert stated == [g for g in LAYERS if g != ("cli", "__init__")] + [("cli",)]
    for path in re.findall(r"\b((?:[a-z_]+/)+[a-z_]+\.py|[a-z_]+\.py)\b", doc):
        full = os.path.join(PKG, path) if "/" in path else None
        if full and not path.startswith("tests/"):
            assert os.path.exists(full), f"docs/ARCHITECTURE.md names {path}, which does not exist"
