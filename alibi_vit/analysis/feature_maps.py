"""Feature maps to look at: PCA to RGB, k-means segments, similarity to a query patch.

For each image and each backbone, the (C, h, w) patch features become four panels:

- ``PCA``: the first three principal components of the (centred) features, as RGB;
- ``PCA std``: the same after standardising every channel (a few high-variance channels,
  e.g. DINOv2's positional ones, no longer dominate);
- ``k-means``: KMeans (scikit-learn, 15 initialisations as in the paper) on standardised
  features, clusters coloured by size (largest first) so panels of different backbones are comparable;
- ``similarity``: cosine similarity of every patch to the query patch, 0 → dark, 1 → bright
  (negative values clip to 0; a colour bar at the right of the row), query marked with a
  white-edged red cross.

The PCA is fitted per model, either on each image alone (``--pca per-image``) or once on the
patches of all images together (``--pca joint``, the command's default, as in the paper's
Fig. S13): then a colour means the same feature direction in every image of that model. Models
are never mixed: each has its own feature space.

Positional bias shows up as colour ramps in the PCA panels, clusters that follow image
position instead of content, and similarity maps that decay with distance from the query.

The ``alibi-vit show`` command (``alibi_vit/cli/show.py``)::

    alibi-vit show --models vit_small_patch14_reg4_dinov2 alibi_vit_small_patch14_reg4_dinov2 \\
        --checkpoint alibi_vit_small_patch14_reg4_dinov2=alibi_dv2_s14.pth \\
        --images textures --out figures/ --size 448 --k 4 --pca joint

``feature_map_grid`` returns the same figure as a (3, H, W) tensor for TensorBoard's ``add_image``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..features import patch_features
from ..images import normalize

__all__ = [
    "COLORBAR_WIDTH", "COLUMNS", "LABEL_HEIGHT", "PAD", "PCAColouring", "cosine_similarity_map", "feature_map_grid",
    "feature_panels", "grid_shape", "kmeans_labels", "pca_rgb", "shared_pca_rgb",
]

COLUMNS = ("image", "PCA", "PCA std", "k-means", "similarity")
PAD = 4  # px between panels and around the figure
LABEL_HEIGHT = 16  # px of the text strip above the header and above every model's row
COLORBAR_WIDTH = 24  # px right of the similarity column: an 8 px colour bar and its 0/1 labels
N_INIT = 15  # k-means initialisations (the paper's)

# Categorical colours for k-means clusters (Tableau 10), extended by evenly spaced hues for k > 10.
_TAB10 = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
          (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207))
# Anchors of the viridis colour map; similarity panels interpolate linearly between them.
_VIRIDIS = ((68, 1, 84), (72, 40, 120), (62, 74, 137), (49, 104, 142), (38, 130, 142), (31, 158, 137),
            (53, 183, 121), (109, 205, 89), (180, 222, 44), (253, 231, 37))


# ---- per-image feature analyses -------------------------------------------------------------

def _as_matrix(features: torch.Tensor) -> np.ndarray:
    """(C, h, w) → (h·w, C) float64 rows, one per patch."""
    if features.dim() != 3:
        raise ValueError(f"features must be (C, h, w), got shape {tuple(features.shape)}")
    c = features.shape[0]
    return features.detach().float().cpu().reshape(c, -1).T.numpy().astype(np.float64)


def _standardise(x: np.ndarray) -> np.ndarray:
    from sklearn.preprocessing import StandardScaler

    return StandardScaler().fit_transform(x)


class PCAColouring:
    """First three principal components as RGB, fitted on the patches of one or more images.

    Fitted on several images of one model (a list of (C, h, w) features), the same colour means
    the same feature direction in all of them. Each component is stretched between its 1st and
    99th percentile over the fitted patches (robust to a few extreme patches); component signs
    are arbitrary, as always with PCA. ``standardise`` scales every channel to unit variance
    first (over the same patches).
    """

    def __init__(self, features, standardise: bool = False):
        from sklearn.decomposition import PCA
        from sklearn.preprocessing import StandardScaler

        feats = [features] if isinstance(features, torch.Tensor) else list(features)
        if not feats:
            raise ValueError("PCAColouring needs the features of at least one image")
        x = np.concatenate([_as_matrix(f) for f in feats])
        self.scaler = StandardScaler().fit(x) if standardise else None
        if self.scaler is not None:
            x = self.scaler.transform(x)
        self.pca = PCA(n_components=min(3, x.shape[0], x.shape[1]), random_state=0).fit(x)
        comps = self._project(x)
        self.lo, self.hi = np.percentile(comps, 1, axis=0), np.percentile(comps, 99, axis=0)

    def _project(self, x: np.ndarray) -> np.ndarray:
        comps = self.pca.transform(x)
        if comps.shape[1] < 3:
            comps = np.concatenate([comps, np.zeros((comps.shape[0], 3 - comps.shape[1]))], axis=1)
        return comps

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """(C, h, w) features → (3, h, w) colours in [0, 1]."""
        _, h, w = features.shape
        x = _as_matrix(features)
        if self.scaler is not None:
            x = self.scaler.transform(x)
        comps = self._project(x)
        rgb = np.clip((comps - self.lo) / np.where(self.hi > self.lo, self.hi - self.lo, 1.0), 0.0, 1.0)
        return torch.from_numpy(rgb.T.reshape(3, h, w)).float()


def pca_rgb(features: torch.Tensor, standardise: bool = False) -> torch.Tensor:
    """First three principal components of one image's patch features as a (3, h, w) image in [0, 1].

    The PCA is fitted on this image alone; see :class:`PCAColouring` for one fit over several.
    """
    return PCAColouring(features, standardise=standardise)(features)


def shared_pca_rgb(features: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) features → (B, 3, h, w) in [0, 1]: the first three principal components as RGB.

    One PCA over all images' patches, so colours are comparable between images; components
    are sign-fixed (largest loading positive) so colours do not flip between validations.
    """
    B, C, h, w = features.shape
    x = features.detach().float().permute(0, 2, 3, 1).reshape(-1, C)
    x = x - x.mean(dim=0, keepdim=True)
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    comps = vh[:3]
    comps = comps * torch.sign(comps.gather(1, comps.abs().argmax(dim=1, keepdim=True)))
    proj = x @ comps.T
    if proj.shape[1] < 3:  # fewer than 3 channels: pad with grey
        proj = torch.cat([proj, proj.new_zeros(proj.shape[0], 3 - proj.shape[1])], dim=1)
    lo, hi = proj.min(dim=0).values, proj.max(dim=0).values
    rgb = (proj - lo) / (hi - lo).clamp_min(1e-8)
    return rgb.reshape(B, h, w, 3).permute(0, 3, 1, 2).clamp(0.0, 1.0)


def kmeans_labels(features: torch.Tensor, k: int = 4, n_init: int = N_INIT, seed: int = 0) -> torch.Tensor:
    """KMeans on standardised patch features → (h, w) cluster ids, 0 = the largest cluster."""
    from sklearn.cluster import KMeans

    _, h, w = features.shape
    if not 1 <= k <= h * w:
        raise ValueError(f"k must be between 1 and the number of patches ({h * w}), got {k}")
    labels = KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit_predict(_standardise(_as_matrix(features)))
    order = np.argsort(-np.bincount(labels, minlength=k), kind="stable")  # relabel by size
    rank = np.empty(k, dtype=np.int64)
    rank[order] = np.arange(k)
    return torch.from_numpy(rank[labels].reshape(h, w))


def cosine_similarity_map(features: torch.Tensor, query) -> torch.Tensor:
    """Cosine similarity (h, w) of every patch's features to the patch at ``query`` = (row, col)."""
    _, h, w = features.shape
    y, x = (int(q) for q in query)
    if not (0 <= y < h and 0 <= x < w):
        raise ValueError(f"query patch ({y}, {x}) is outside the {h}×{w} patch grid")
    f = features.detach().float()
    return F.cosine_similarity(f, f[:, y:y + 1, x:x + 1], dim=0)


# ---- colouring and layout -------------------------------------------------------------------

def _palette(k: int) -> torch.Tensor:
    colours = list(_TAB10[:k])
    if k > len(_TAB10):
        import colorsys

        extra = k - len(_TAB10)
        colours += [tuple(round(255 * c) for c in colorsys.hsv_to_rgb(i / extra, 0.65, 0.9)) for i in range(extra)]
    return torch.tensor(colours, dtype=torch.float32) / 255.0


def _colour_labels(labels: torch.Tensor, k: int) -> torch.Tensor:
    return _palette(k)[labels].permute(2, 0, 1)


def _viridis(values: torch.Tensor) -> torch.Tensor:
    """Values in [0, 1] (h, w) → (3, h, w) colours by linear interpolation between viridis anchors."""
    anchors = torch.tensor(_VIRIDIS, dtype=torch.float32) / 255.0
    pos = values.clamp(0, 1) * (len(anchors) - 1)
    lo = pos.floor().long().clamp(max=len(anchors) - 2)
    frac = (pos - lo).unsqueeze(-1)
    return (anchors[lo] * (1 - frac) + anchors[lo + 1] * frac).permute(2, 0, 1)


def _upsample(panel: torch.Tensor, size) -> torch.Tensor:
    """Patch-grid panel → image size; nearest keeps patches visible as blocks."""
    return F.interpolate(panel[None], size=tuple(size), mode="nearest")[0]


def _mark(panel: torch.Tensor, y: int, x: int, radius=None) -> torch.Tensor:
    """Red cross with a white edge centred at pixel (y, x), visible on dark and bright panels alike.

    ``radius`` (px) defaults to 1/20 of the shorter side, at least 4.
    """
    panel = panel.clone()
    h, w = panel.shape[-2:]
    r = max(4, min(h, w) // 20) if radius is None else int(radius)

    def cross(half_width, colour):
        colour = torch.tensor(colour).view(3, 1, 1)
        rows, cols = slice(max(y - r, 0), y + r + 1), slice(max(x - r, 0), x + r + 1)
        panel[:, max(y - half_width, 0):y + half_width + 1, cols] = colour
        panel[:, rows, max(x - half_width, 0):x + half_width + 1] = colour

    cross(2, (1.0, 1.0, 1.0))
    cross(1 if r >= 6 else 0, (1.0, 0.1, 0.1))
    return panel


def _colour_bar(height: int, width: int = 8) -> torch.Tensor:
    """(3, height, width) viridis gradient, 1 at the top to 0 at the bottom: the similarity panels' scale."""
    values = torch.linspace(1.0, 0.0, height).view(height, 1).expand(height, width)
    return _viridis(values)


def feature_panels(features: torch.Tensor, image: torch.Tensor, k: int = 4, query=None,
                   patch_size=(14, 14), n_init: int = N_INIT, pca=None, pca_std=None) -> dict[str, torch.Tensor]:
    """The five panels of ``COLUMNS`` for one image (3, H, W) in [0, 1] and its (C, h, w) features.

    ``query`` = (y, x) in image pixels (default: the centre); every panel is (3, H, W) in [0, 1].
    ``pca``/``pca_std`` are fitted :class:`PCAColouring` s (e.g. over all images of this model);
    by default a PCA is fitted on this image alone.
    """
    H, W = image.shape[-2:]
    _, h, w = features.shape
    qy, qx = (H // 2, W // 2) if query is None else (int(query[0]), int(query[1]))
    if not (0 <= qy < H and 0 <= qx < W):
        raise ValueError(f"query pixel ({qy}, {qx}) is outside the {H}×{W} image")
    ph, pw = patch_size
    similarity = cosine_similarity_map(features, (min(qy // ph, h - 1), min(qx // pw, w - 1)))
    panels = {
        "image": _mark(image.float().clamp(0, 1), qy, qx),
        "PCA": _upsample(pca(features) if pca is not None else pca_rgb(features), (H, W)),
        "PCA std": _upsample(pca_std(features) if pca_std is not None else pca_rgb(features, standardise=True),
                             (H, W)),
        "k-means": _upsample(_colour_labels(kmeans_labels(features, k, n_init=n_init), k), (H, W)),
        "similarity": _mark(_upsample(_viridis(similarity), (H, W)), qy, qx),
    }
    return panels


def grid_shape(n_models: int, panel_size, n_columns: int = len(COLUMNS)) -> tuple[int, int]:
    """(height, width) in px of the figure ``feature_map_grid`` draws.

    Layout: a header strip (LABEL_HEIGHT) with the column titles, then per model a strip with
    its name (LABEL_HEIGHT) over a row of panels followed by the similarity colour bar
    (COLORBAR_WIDTH); PAD px between and around everything.
    """
    ph, pw = panel_size
    width = PAD + n_columns * (pw + PAD) + COLORBAR_WIDTH
    height = LABEL_HEIGHT + n_models * (LABEL_HEIGHT + ph + PAD) + PAD
    return height, width


def _draw_text(canvas: torch.Tensor, texts: list[tuple[int, int, str]]) -> torch.Tensor:
    """Write black text at (top, left) positions onto a (3, H, W) float canvas with PIL's built-in font."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.fromarray((canvas.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
    draw = ImageDraw.Draw(img)
    try:
        font = ImageFont.load_default(size=LABEL_HEIGHT - 4)
    except TypeError:  # Pillow < 10.1 has only the fixed bitmap font
        font = ImageFont.load_default()
    for top, left, text in texts:
        draw.text((left, top), text, fill=(0, 0, 0), font=font)
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255.0


def feature_map_grid(models: dict, image: torch.Tensor, k: int = 4, query=None, n_init: int = N_INIT,
                     labels: bool = True, pcas: dict | None = None, features: dict | None = None) -> torch.Tensor:
    """One figure (3, H, W) in [0, 1]: a row of ``COLUMNS`` panels per model, for TensorBoard or PNG.

    ``models`` maps a row label to a backbone (timm ViT); ``image`` is (3, H, W) in [0, 1], both
    sides multiples of the patch size. ``pcas`` maps a row label to a (PCA, PCA std) pair of
    fitted :class:`PCAColouring` (default: fitted on this image); ``features`` maps it to this
    image's (C, h, w) features when they are already computed. Use
    ``SummaryWriter.add_image(tag, grid)`` (CHW).
    """
    if not models:
        raise ValueError("feature_map_grid needs at least one model")
    H, W = image.shape[-2:]
    height, width = grid_shape(len(models), (H, W))
    canvas = torch.ones(3, height, width)
    texts = [(2, PAD + c * (W + PAD), title + (f" k={k}" if title == "k-means" else ""))
             for c, title in enumerate(COLUMNS)]
    for r, (name, model) in enumerate(models.items()):
        feats = (features or {}).get(name)
        if feats is None:
            device = next(model.parameters()).device
            with torch.no_grad():
                feats = patch_features(model, normalize(image)[None].to(device))[0].cpu()
        pca, pca_std = (pcas or {}).get(name, (None, None))
        panels = feature_panels(feats, image, k=k, query=query, patch_size=tuple(model.patch_embed.patch_size),
                                n_init=n_init, pca=pca, pca_std=pca_std)
        top = LABEL_HEIGHT + r * (LABEL_HEIGHT + H + PAD) + LABEL_HEIGHT
        texts.append((top - LABEL_HEIGHT + 2, PAD, str(name)))
        for c, column in enumerate(COLUMNS):
            left = PAD + c * (W + PAD)
            canvas[:, top:top + H, left:left + W] = panels[column]
        bar_left = PAD + len(COLUMNS) * (W + PAD)
        canvas[:, top:top + H, bar_left:bar_left + 8] = _colour_bar(H)
        texts += [(top, bar_left + 10, "1"), (top + H - LABEL_HEIGHT + 2, bar_left + 10, "0")]
    return _draw_text(canvas, texts) if labels else canvas
