"""Building backbones by name and loading plain timm state_dicts strictly.

An exported student (``alibi-vit export`` → ``.safetensors``) records the architecture it was
trained with (``model_kwargs``/``student_kwargs`` in the file's metadata); ``create_backbone``
reads them, so a checkpoint of a non-default architecture loads without ``--model-arg``.
"""

from __future__ import annotations

import difflib
import json
import pickle
import re
import warnings
from pathlib import Path

import timm
import torch
import torch.nn as nn

from ..files import require_file
from .formats import key_mismatches
from .names import MODEL_NAMES

__all__ = ["WeightsUnavailableError", "check_model_name", "checkpoint_metadata", "create_backbone", "load_state_dict_file",
           "load_weights", "local_pretrained_overlay", "read_torch_file", "save_safetensors"]

# Wrappers other tools put around a state_dict: Lightning ('state_dict'), DDP ('module.').
_NESTING_KEYS = ("state_dict", "model")
# How many keys of each kind a mismatch report names (the full lists can run to thousands of characters).
_SHOWN_KEYS = 5


def _load_error(err: Exception) -> str:
    """Why torch.load failed, in our words: torch's own text advises ``weights_only=False``, which
    would run arbitrary pickled code, so it is never passed on."""
    text = str(err)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found or "can still be loaded" in text:
        what = f" (e.g. {found.group(1)})" if found else ""
        return (f"it holds pickled Python objects besides tensors{what}; only plain state_dicts and Lightning "
                "checkpoints are read, without running pickled code")
    return f"the file is corrupted, truncated or not a PyTorch checkpoint ({type(err).__name__})"


def read_torch_file(path, what: str = "checkpoint"):
    """``torch.load(path, weights_only=True)`` on the CPU; a file it cannot read is a one-line ValueError.

    Only tensors and plain containers are unpickled, so no code from the file runs; the error never
    repeats torch's advice to retry with ``weights_only=False``.
    """
    import warnings

    try:
        with warnings.catch_warnings():  # torch's notes on old pickle protocols: the callers check the content
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, OSError) as err:
        raise ValueError(f"cannot read {what} {path}: {_load_error(err)}") from None


def save_safetensors(state: dict[str, torch.Tensor], path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` with the permissions any other file gets (the umask's), not 0600.

    safetensors writes through a private temporary file, so its output is readable by its owner
    only: shared weights (a group's model folder, a cluster's project space) would not be.
    """
    import os

    from safetensors.torch import save_file

    save_file(state, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def load_state_dict_file(path) -> dict[str, torch.Tensor]:
    """Read a state_dict from .safetensors, .pt/.pth/.bin or a Lightning .ckpt (its 'state_dict')."""
    path = require_file(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            state = load_file(str(path))
        except Exception as err:  # SafetensorError and OSError: the message is short and to the point
            raise ValueError(f"cannot read checkpoint {path}: not a valid safetensors file ({err})") from None
    else:
        state = read_torch_file(path)
    for key in _NESTING_KEYS:
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"checkpoint {path} does not hold a state_dict of tensors")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def checkpoint_metadata(path) -> dict:
    """The architecture an exported checkpoint records: ``{"model": name, "model_kwargs": {...}}``.

    ``model_kwargs`` merges the export's ``model_kwargs`` and ``student_kwargs`` (how the student
    was built). Files without such metadata (``.pth``, plain timm files) give ``{}``.
    """
    path = Path(path)
    if path.suffix != ".safetensors" or not path.is_file():
        return {}
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:  # unreadable: load_state_dict_file reports it with a proper message
        return {}
    kwargs = {}
    for key in ("model_kwargs", "student_kwargs"):
        if meta.get(key):
            try:
                value = json.loads(meta[key])
            except json.JSONDecodeError:
                raise ValueError(f"checkpoint {path}: its metadata {key!r} is not JSON: {meta[key]!r}") from None
            kwargs.update(value or {})
    out = {"model_kwargs": kwargs} if kwargs else {}
    if meta.get("model") and meta["model"] != "None":
        out["model"] = meta["model"]
    return out


def _first(keys, n: int = _SHOWN_KEYS) -> str:
    shown = ", ".join(keys[:n])
    return shown + (f", … ({len(keys) - n} more)" if len(keys) > n else "")


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str = "state_dict") -> None:
    """Load strictly; a key or shape mismatch is a ValueError that counts each kind and names the first keys.

    Models that translate other checkpoint formats (released files without ``pos_embed``, Meta's
    DINOv3 key names) do it in their ``adapt_state_dict`` first, so the comparison sees their own keys.
    """
    adapt = getattr(model, "adapt_state_dict", None)
    if adapt is not None:
        state_dict = adapt(state_dict)
    own = model.state_dict()
    missing, unexpected, shapes = key_mismatches(own, state_dict)
    if missing or unexpected or shapes:
        lines = [f"{source} does not match {type(model).__name__} ({len(own)} tensors; checkpoint "
                 f"{len(state_dict)}):"]
        for title, keys, n in (("missing keys", missing, _SHOWN_KEYS), ("unexpected keys", unexpected, _SHOWN_KEYS),
                               ("shape mismatches", shapes, 3)):
            if keys:
                lines.append(f"  {title} ({len(keys)}): {_first(keys, n)}")
        students = {k[len("student."):] for k in unexpected if k.startswith("student.")}
        if students:  # (exported, the file also records the student's architecture: no --model-arg needed)
            ckpt = source[len("checkpoint "):] if source.startswith("checkpoint ") else "CKPT"
            lines.append("  it holds a distillation run (keys student.*): export the student first, "
                         f"with alibi-vit export --checkpoint {ckpt} --out student.safetensors")
        elif missing or shapes:
            lines.append("  a different architecture? build the model with the checkpoint's own arguments "
                         "(alibi-vit: --model-arg KEY=VALUE, e.g. depth=2)")
        raise ValueError("\n".join(lines))
    model.load_state_dict(state_dict, strict=True)


def check_model_name(name: str) -> None:
    """A ValueError naming close matches (timm's models and this project's) when timm does not know ``name``."""
    if timm.is_model(name):
        return
    known = sorted(set(timm.list_models()) | set(MODEL_NAMES))
    # A name cut short is the usual typo: names it begins come first, then the closest spellings.
    close = [n for n in known if n.startswith(name.partition(".")[0])][:4]
    close = close or difflib.get_close_matches(name, known, n=4, cutoff=0.6)
    hint = (f"did you mean {', '.join(close)}?" if close else
            "this project's are alibi_vit_*/nope_vit_* of DINOv2 (patch14_reg4_dinov2) and DINOv3 "
            "(patch16_dinov3), and the baselines blanked_/tavg_/sincos_vit_small_patch14_reg4_dinov2, each with "
            "weight tags (docs/models.md: model names and tags); timm.list_models('*dinov*') lists timm's")
    raise ValueError(f"unknown model {name!r}; {hint}")



class WeightsUnavailableError(ValueError):
    """Pretrained weights that are not in the local hub cache and cannot be downloaded from here.

    ``reason`` says why; callers with their own option names (a config's checkpoint key) reword the way out.
    """

    def __init__(self, name: str, reason: str, repo: str | None = None):
        self.name, self.reason, self.repo = name, reason, repo
        fetch = f", or run `hf download {repo}` where there is network and copy the hub cache here" if repo else ""
        super().__init__(f"cannot load the pretrained weights of {name}: {reason}; give --checkpoint PATH (a local "
                         f"weights file){fetch}")


# How long one metadata request to the hub may take before the hub counts as unreachable.
HUB_TIMEOUT_SECONDS = 5.0


def local_pretrained_overlay(name: str, model_kwargs: dict | None = None,
                             timeout: float = HUB_TIMEOUT_SECONDS) -> dict:
    """Where timm should take ``name``'s pretrained weights from, decided before timm tries.

    Returns extra ``timm.create_model`` kwargs: ``{"pretrained_cfg_overlay": {"file": PATH}}`` when the
    weights are in the local Hugging Face cache (timm then reads that file and never touches the
    network, which it otherwise does, retrying for about a minute when there is none), or ``{}``
    when timm should download them (not cached, hub reachable) or when the weights do not come from
    the hub (a ``file``/``url``/``state_dict`` in ``model_kwargs["pretrained_cfg_overlay"]``, a model
    timm fetches by URL, a name timm does not know: timm reports those itself).

    Raises :class:`WeightsUnavailableError` when the weights are not cached and cannot be downloaded:
    timm has none for the model, ``HF_HUB_OFFLINE`` is set, or one metadata request (no retries,
    through the same route a download takes, proxies included) fails within ``timeout`` seconds.
    """
    from timm.models import get_pretrained_cfg

    overlay = dict((model_kwargs or {}).get("pretrained_cfg_overlay") or {})
    if any(overlay.get(k) for k in ("file", "url", "state_dict")) or not timm.is_model(name):
        return {}
    cfg = get_pretrained_cfg(name)
    hub_id = overlay.get("hf_hub_id") or (cfg.hf_hub_id if cfg is not None else None)
    if not hub_id:
        if cfg is None or not (cfg.url or cfg.file):
            raise WeightsUnavailableError(name, "timm has no pretrained weights for this model")
        return {}
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    repo_id, _, revision = hub_id.partition("@")
    revision = revision or None
    hub_file = overlay.get("hf_hub_filename") or (cfg.hf_hub_filename if cfg is not None else None)
    # timm's own order for a hub model: safetensors first, then the pickle file
    filenames = [hub_file] if hub_file else ["model.safetensors", "pytorch_model.bin"]
    for filename in filenames:
        cached = huggingface_hub.try_to_load_from_cache(repo_id, filename, revision=revision)
        if isinstance(cached, str):
            return {"pretrained_cfg_overlay": {**overlay, "file": cached}}
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise WeightsUnavailableError(name, f"{hub_id} is not in the local cache, and HF_HUB_OFFLINE is set",
                                      repo_id)
    url = huggingface_hub.hf_hub_url(repo_id, filenames[0], revision=revision)
    try:  # one request, no retries: fast to fail, and a download that follows uses the same route (proxies)
        huggingface_hub.get_hf_file_metadata(url, timeout=timeout)
    except HfHubHTTPError:
        pass  # the hub answered (e.g. no such file here): timm picks the file and reports what it finds
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise WeightsUnavailableError(name, f"{hub_id} is not in the local cache, and the hub cannot be reached "
                                            f"({type(err).__name__}{': ' + reason[:80] if reason else ''})",
                                      repo_id) from None
    return {}


def create_backbone(name: str, *, pretrained: bool = False, checkpoint=None, seed: int | None = None,
                    **model_kwargs) -> nn.Module:
    """A feature backbone by timm name: ALiBi/NoPE models of this project or any timm ViT.

    Plain timm ViTs (the DINOv2 teacher, say) get ``dynamic_img_size=True`` so that, like the
    ALiBi models, they take any image size that is a multiple of the patch size (their
    position embedding is interpolated; that is what DINOv2 does). ``checkpoint`` is a plain
    timm state_dict file loaded strictly after the model is built; when it records the
    architecture it was exported with (see :func:`checkpoint_metadata`), those kwargs are used,
    and ``model_kwargs`` given here override them with a warning where they disagree.
    A file holding ``rasa_projection`` (a RASA export) gives the folded model. Unknown names and
    arguments the model does not take are ValueErrors. ``seed`` draws the initial (random) weights
    from that seed, so two calls give the same model; the global random state is left as it was.
    """
    check_model_name(name)
    from_file = {}
    if checkpoint is not None:
        meta = checkpoint_metadata(checkpoint)
        recorded = meta.get("model_kwargs", {})
        conflicts = {k: (recorded[k], v) for k, v in model_kwargs.items() if k in recorded and recorded[k] != v}
        if conflicts:
            warnings.warn(f"checkpoint {checkpoint} was exported with "
                          + ", ".join(f"{k}={old!r}" for k, (old, _) in conflicts.items())
                          + "; using the given " + ", ".join(f"{k}={new!r}" for k, (_, new) in conflicts.items()),
                          stacklevel=2)
        if meta.get("model") and meta["model"] != name:
            warnings.warn(f"checkpoint {checkpoint} holds a {meta['model']}; building {name}", stacklevel=2)
        from_file = {k: v for k, v in recorded.items() if k not in model_kwargs}
        model_kwargs = {**recorded, **model_kwargs}
    given = ", ".join(f"{k}={v!r}" for k, v in model_kwargs.items())
    if name.partition(".")[0] not in MODEL_NAMES:  # "NAME.TAG" picks weights, not the architecture
        model_kwargs.setdefault("dynamic_img_size", True)
    model_kwargs.setdefault("num_classes", 0)
    if pretrained:  # before any download: weights that cannot be had are one clear error, at once
        model_kwargs.update(local_pretrained_overlay(name, model_kwargs))
    try:
        # With a seed, the initial weights come from it alone and the global random state is left as it was;
        # without, model creation draws from (and advances) the global state as usual.
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            model = timm.create_model(name, pretrained=pretrained, **model_kwargs)
    except (TypeError, ValueError, AssertionError, ArithmeticError, RuntimeError) as err:
        # an argument the architecture does not take, or a value it cannot use (patch_size=0, embed_dim=-1)
        source = f" ({', '.join(from_file)} from the checkpoint's metadata)" if from_file else ""
        raise ValueError(f"cannot build {name} with {given or 'its defaults'}{source}: "
                         f"{err or type(err).__name__}") from err
    if len(getattr(model, "blocks", [None])) == 0:  # depth=0: patch embedding and norm only, nothing to probe
        raise ValueError(f"cannot build {name} with {given}: a backbone needs at least one transformer block")
    if checkpoint is not None:
        state = load_state_dict_file(checkpoint)
        from .projection import PROJECTION_KEY, attach_projection

        if PROJECTION_KEY in state:  # a RASA-folded backbone (alibi_vit.analysis.rasa.fold_planes): fold, then load
            attach_projection(model, torch.eye(model.num_features))
        load_weights(model, state, source=f"checkpoint {checkpoint}")
    return model
