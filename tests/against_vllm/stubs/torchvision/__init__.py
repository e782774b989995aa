"""A stand-in for torchvision, for vLLM's Qwen3.5 code on a machine without a working torchvision.

vLLM 0.32's qwen3_5.py imports qwen3_vl.py, which imports transformers' Qwen2-VL image processor,
which imports torchvision at module level, even for the text model (the CUDA torchvision wheel does
not load on the CPU build, and nothing may be installed into the shared vLLM environment). Only the
names are needed: under --language-model-only no image is ever processed and no weight touches
torchvision. Every `torchvision.*` module and attribute is a placeholder that fails when called.

Put on PYTHONPATH by textonly.env() for the architectures of textonly.TEXT_ONLY only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+reshard.stub"


class _Placeholder:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is the reshard test harness's torchvision stub; it cannot run")

    def __mro_entries__(self, bases):
        return (object,)


def _module_getattr(prefix: str):
    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{prefix}.{attr}")

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__dict__["__getattr__"] = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__getattr__ = _module_getattr("torchvision")
