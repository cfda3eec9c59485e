"""ViTs without positional bias: DINOv2 with a 2D wrapped ALiBi attention bias (ALiBi-Dv2).

Packages: ``models`` (the models and their weights), ``analysis`` (evaluations of frozen
backbones), ``trainable`` (trainable segmentation) and ``cli`` (the ``alibi-vit`` command); beside
them ``images``, ``features`` and ``synthetic``, which all of them use.

Importing this package registers the timm models ``alibi_vit_*``/``nope_vit_*`` (DINOv2 and
DINOv3) and the baselines ``blanked_``/``tavg_``/``sincos_vit_small_patch14_reg4_dinov2``: at
once if timm is already imported, otherwise as soon as timm is (``timm.create_model`` needs
``import timm`` anyway). Everything else loads on first
use, so ``import alibi_vit`` and the ``alibi-vit`` command's help do not pay for PyTorch, timm
or scikit-learn.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__all__ = ["BASELINE_NAMES", "DINOV3_NAMES", "MODEL_NAMES", "RELEASES", "AlibiEva", "AlibiVisionTransformer",
           "blank_channels", "check_model_name", "checkpoint_metadata", "convert_to_alibi", "convert_to_nope",
           "create_backbone", "grid_size_of", "load_state_dict_file", "load_weights", "patch_features",
           "transform_average"]

# Public names and the submodule that defines each (PEP 562: imported when first used).
_ATTRIBUTES = {
    "MODEL_NAMES": "models.names", "DINOV3_NAMES": "models.names", "BASELINE_NAMES": "models.names",
    "RELEASES": "models.names",
    "AlibiEva": "models.dinov3", "blank_channels": "models.baselines", "transform_average": "models.baselines",
    "AlibiVisionTransformer": "models.vision_transformer", "convert_to_alibi": "models.vision_transformer",
    "convert_to_nope": "models.vision_transformer",
    "check_model_name": "models.checkpoint", "checkpoint_metadata": "models.checkpoint",
    "create_backbone": "models.checkpoint", "load_state_dict_file": "models.checkpoint",
    "load_weights": "models.checkpoint",
    "grid_size_of": "features", "patch_features": "features",
}


def __getattr__(name):
    if name in _ATTRIBUTES:
        return getattr(importlib.import_module(f".{_ATTRIBUTES[name]}", __name__), name)
    # ``alibi_vit.analysis.probe`` after a bare ``import alibi_vit``: subpackages load on first use.
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_ATTRIBUTES))


class _RegisterModelsAfterTimm(importlib.abc.MetaPathFinder):
    """Imports ``alibi_vit.models.registry`` (which registers the models) right after timm's first import.

    It only finds timm's spec through the other finders and extends that spec's loader, once.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "timm":
            return None
        # A new list, not one changed in place: another thread's import may be going through the old one.
        sys.meta_path = [finder for finder in sys.meta_path if finder is not self]
        spec = importlib.util.find_spec("timm")  # the ordinary finders, now without this one
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, exec_module = spec.loader, spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            del loader.exec_module  # back to the loader's own method
            importlib.import_module(f"{__name__}.models.registry")

        loader.exec_module = exec_then_register
        return spec


if "timm" in sys.modules:
    from .models import registry  # noqa: F401  (registers the timm models)
elif not any(type(finder).__name__ == "_RegisterModelsAfterTimm" for finder in sys.meta_path):  # once, even on reload
    sys.meta_path.insert(0, _RegisterModelsAfterTimm())
