"""The front door holds: every block of README.md and docs/ that quotes results or settings is
its rendering from the committed files (experiments/update_docs.py), README.md stays a
reference page (at most 250 lines, the main command near the top, no dated prose), and every
link and docs/SUPO.md reference resolves inside the repository."""
import glob
import importlib.util
import os
import re

import pytest

from tests.readme_helpers import README, ROOT

_spec = importlib.util.spec_from_file_location(
    "update_docs", os.path.join(ROOT, "experiments", "update_docs.py"))
U = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(U)


@pytest.mark.parametrize("fn", sorted(U.BLOCKS))
def test_generated_blocks_are_their_rendering(fn):
    text = open(os.path.join(ROOT, fn)).read()
    assert U.render(text, U.BLOCKS[fn]) == text, (
        f"{fn}: a block differs from its rendering; run python experiments/update_docs.py")


def test_blocks_follow_their_sources(monkeypatch):
    """A changed source changes its block (the check above cannot pass on a stale block)."""
    from supo_jax.configs import cpu_recipe

    before = U.departures()
    monkeypatch.setitem(cpu_recipe.DEPARTURES, "optim.lr", "a changed reason")
    assert U.departures() != before and "a changed reason" in U.departures()
    steps, final, first = U.quickstart_metrics()
    assert first["success_rate"] == pytest.approx(0.53125) and len(steps) == 30


def test_readme_is_a_reference_page():
    lines = README.splitlines()
    assert len(lines) <= 250
    assert any(ln.strip() == "supo-jax train" for ln in lines[:40])
    prose = re.sub(r"<!-- (\w+):begin -->.*?<!-- \1:end -->", "", README, flags=re.S)
    assert not re.findall(r"20\d\d-[01]\d-[0-3]\d", prose)


def _links(path):
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
    return [m for m in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in m]


@pytest.mark.parametrize("path", ["README.md", *sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))])
def test_relative_links_resolve(path):
    base = os.path.dirname(os.path.join(ROOT, path))
    missing = [m for m in _links(os.path.join(ROOT, path))
               if m.split("#")[0] and not os.path.exists(os.path.join(base, m.split("#")[0]))]
    assert not missing, missing


def test_supo_md_references_resolve():
    """Docstrings cite docs/SUPO.md by section: each cited section is a heading there."""
    heads = set(re.findall(r"^## (§\d+)", open(os.path.join(ROOT, "docs", "SUPO.md")).read(),
                           re.M))
    cited = set()
    for p in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True):
        if ".venv" in p:
            continue
        for m in re.findall(r"SUPO\.md (§\d+)(?:-(§\d+))?", open(p).read()):
            cited.update(x for x in m if x)
    assert cited and cited <= heads, cited - heads


def test_every_subcommand_has_its_generated_flag_table():
    """CLI.md cannot miss a subcommand or a flag: each has a block rendered from the parser."""
    names = set(U._subcommands())
    blocks = U.BLOCKS[os.path.join("docs", "CLI.md")]
    assert {f"cli_{n}" for n in names} | {"cli_commands"} == set(blocks)
    for n in names:
        for a in U._subcommands()[n][1]._actions[1:]:     # after --help
            assert a.option_strings[-1] in blocks[f"cli_{n}"](), (n, a.option_strings)
