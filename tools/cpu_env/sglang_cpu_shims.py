"""Import-time shims that let SGLang 0.5.23 import on a CPU-only machine.

Installed into the project's virtual environment by ``make`` (with a ``.pth`` line that
imports this module); never part of the product. PyPI's torchvision 0.28.0 is a CUDA
build whose meta registrations fail on CPU torch with "operator torchvision::nms does
not exist". Defining the two operator schemas before torchvision is first imported
cures it. The definition happens lazily, only when something imports torchvision.
"""

import importlib.abc
import sys


class _TorchvisionSchemaFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            _define_torchvision_schemas()
        return None


def _define_torchvision_schemas():
    import torch

    global _LIBRARY
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    _LIBRARY.define(
        "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
    )
    _LIBRARY.define(
        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
    )


if not any(isinstance(f, _TorchvisionSchemaFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionSchemaFinder())
