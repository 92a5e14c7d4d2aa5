"""Import-only torchvision stand-in: any ``torchvision.*`` import yields an empty module (CPU tests)."""
import enum
import importlib.abc
import importlib.machinery
import sys
import types


class _Mod(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return enum.Enum("InterpolationMode", "NEAREST BILINEAR BICUBIC BOX HAMMING LANCZOS NEAREST_EXACT")
        return type(name, (), {"__init__": lambda self, *a, **k: None})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Mod(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0+stub"
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
