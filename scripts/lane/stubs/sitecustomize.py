"""Empty stand-ins for compiled kernel packages a lane machine lacks (loaded as `sitecustomize`).

Argument resolution imports these packages but never runs their kernels. The finder sits at the END of
sys.meta_path, so a package that is really installed (FlashInfer's Python layer is carried) always wins;
`STUBBED` lists what was stubbed, and the lane writes it into its results.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types

# Compiled packages that SGLang 0.5.23 imports at module level on the resolution path.
STUB = {"sgl_kernel", "deep_gemm", "triton_kernels", "humming", "torch_memory_saver", "IPython", "flash_attn",
        "sgl_flash_mla", "quack", "tilelang", "kernels", "deep_ep", "nvshmem", "cuda", "xgrammar",
        "llguidance", "outlines", "mooncake", "aiter", "smg_grpc_servicer", "cuda_bindings"}
# A trial run where an installed package cannot import (PyPI's torchvision beside a CPU-only torch):
# these are stubbed even when installed.
FORCED = {m for m in os.environ.get("K31_LANE_FORCE_STUBS", "").split(",") if m}
STUBBED: set[str] = set()


class _Meta(type):
    """A stub class: any attribute, subscript (`Type[...]`) or union (`A | B`) is another stub."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _mk(name)

    def __getitem__(cls, item):
        return _mk(f"{cls.__name__}[]")

    def __or__(cls, other):
        return _mk(f"{cls.__name__}|")

    __ror__ = __or__


def _mk(name):
    def getattr_(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _mk(attr)

    return _Meta(name, (), {"__init__": lambda self, *a, **k: None, "__getattr__": getattr_,
                            "__call__": lambda self, *a, **k: None})


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _mk(name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.names:
            STUBBED.add(fullname.split(".")[0])
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder(FORCED))
sys.meta_path.append(_Finder(STUB))
