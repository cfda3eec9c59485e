"""ViTs without positional bias: DINOv2 with a 2D wrapped ALiBi attention bias (ALiBi-Dv2).

Importing this package registers the timm models ``alibi_vit_*_patch14_reg4_dinov2`` and
``nope_vit_*_patch14_reg4_dinov2``.
"""

from . import images, models, probe  # noqa: F401  (models registers the timm models)
from .checkpoint import create_backbone, load_state_dict_file, load_weights
from .features import grid_size_of, patch_features
from .models import MODEL_NAMES
from .vision_transformer import AlibiVisionTransformer, convert_to_alibi, convert_to_nope

__all__ = ["MODEL_NAMES", "AlibiVisionTransformer", "convert_to_alibi", "convert_to_nope", "create_backbone",
           "grid_size_of", "load_state_dict_file", "load_weights", "patch_features"]
