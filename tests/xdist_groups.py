"""pytest-xdist's `xdist_group` under pytest >= 9.2 (tests/conftest.py calls it; `-p xdist_groups`
loads it as a plugin: tests/test_xdist_groups.py)."""
import pytest


def name_xdist_groups(config, items):
    """On a pytest-xdist worker under `--dist loadgroup`: end the node id of each item marked
    `xdist_group` with `@<group>`, which is how the controller's scheduler sends a group to one
    worker. pytest-xdist does this itself by setting `item._nodeid`, which pytest >= 9.2 no
    longer reads (node ids live in `item._id`): each module's fixtures were then built on both
    workers (test_benchmarks' six benchmark runs twice, 400 s each, in CI)."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        # "@" already there: pytest-xdist's own suffix took (a pytest before 9.2)
        if names and "@" not in item.nodeid:
            from _pytest.nodeid import coerce_node_id     # pytest >= 9.2: ids in `_id`
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(sorted(names))}")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    name_xdist_groups(config, items)
