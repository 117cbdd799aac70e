"""Empty stand-ins for the vendor SDKs bfcl-eval's `bfcl` command imports at start-up.

bfcl-eval is installed with --no-deps (its pins clash with ours: README), and its command
imports every provider's handler module on start (Anthropic's, Cohere's, Bedrock's, ...),
whose SDKs are then missing. tests/test_bfcl_runner.py puts this directory on the PYTHONPATH
of the `bfcl` processes it runs (never of the test's own process): each module below that is
not installed is an empty module whose attributes are mocks, enough to import; the local
Completions-API handler the tests drive uses none of them. Nothing of bfcl-eval is changed.
"""
import importlib.abc
import importlib.machinery
import sys
import types
from unittest.mock import MagicMock

MISSING = {"anthropic", "boto3", "cohere", "mistralai", "qwen_agent", "writerai",
           "datamodel_code_generator", "pandas", "tree_sitter", "tree_sitter_java",
           "tree_sitter_javascript"}


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] not in MISSING and not fullname.startswith("google.genai"):
            return None
        for finder in sys.meta_path:        # an installed module is used as it is
            if finder is not self:
                try:
                    if finder.find_spec(fullname, path, target) is not None:
                        return None
                except Exception:  # noqa: BLE001 - a finder that fails finds nothing
                    pass
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
