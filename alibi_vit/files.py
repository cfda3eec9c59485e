"""Checks on the files a user names, light enough to run before any heavy import."""

from __future__ import annotations

from pathlib import Path

__all__ = ["check_folder_path", "require_file", "require_writable_folder"]


def require_file(path, what: str = "checkpoint") -> Path:
    """``path`` as a Path if it is a file; else an error that says whether it is missing or a folder (and, for a
    run folder, which checkpoint inside it to give)."""
    path = Path(path)
    if path.is_dir():
        inside = [p for p in (path / "checkpoints" / "last.ckpt", path / "last.ckpt") if p.is_file()]
        hint = f", e.g. {inside[0]}" if inside else ""
        raise IsADirectoryError(f"{what} {path} is a folder: give the file{hint}")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    return path


def check_folder_path(folder, option: str = "--out") -> None:
    """A ``ValueError`` naming ``option`` when ``folder``, or a folder above it, is an existing file."""
    folder = Path(folder)
    for place in (folder, *folder.parents):
        if place.exists():
            if not place.is_dir():
                raise ValueError(f"{option} {folder}: {place} is an existing file; give a folder")
            return


def require_writable_folder(folder, option: str = "--out") -> Path:
    """Create ``folder`` (and those above it) and check that a file can be written in it; else a one-line
    ``ValueError`` naming ``option``: a file in the way, a read-only file system, no permission."""
    import tempfile

    folder = Path(folder)
    check_folder_path(folder, option)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ValueError(f"{option}: cannot write in {folder} ({err.strerror or err})") from None
    return folder
