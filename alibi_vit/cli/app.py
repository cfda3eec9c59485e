"""``alibi-vit app``: interactive trainable segmentation in the browser.

    alibi-vit app [DIR_OR_FILES ...] [--session DIR] [--host 127.0.0.1] [--port 8765]
        [--backbone NAME (--checkpoint PATH | --pretrained | --allow-random-init)] [--max-megapixels N]

Starts a local web server (see :mod:`alibi_vit.app`) and prints the URL to open. On 127.0.0.1 (the
default) only this machine can connect; any other host needs the token printed in the URL. Files
given that cannot be added (unreadable, too large, of another pixel kind, a link out of the folders
given) are skipped with a warning. Stop it with Ctrl-C: everything is already in the session folder.
"""

from __future__ import annotations

import argparse
import secrets
import socket
import sys
import threading
from pathlib import Path

from ..app.imagefiles import DEFAULT_MAX_PIXELS

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .segment import _add_backbone_arguments

    parser.add_argument("sources", nargs="*", metavar="DIR_OR_FILE",
                        help="image folders and/or files to segment (PNG, TIFF incl. 16-bit and multi-page, JPEG); "
                             "more can be uploaded in the page")
    parser.add_argument("--session", type=Path, default=Path("alibi-vit-session"), metavar="DIR",
                        help="session folder: classes, labels and strokes, saved as you draw; give it again to "
                             "continue (default %(default)s)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="where Save writes labels, model, masks, overlays, fractions (default SESSION/export)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default %(default)s: this machine only; any other needs the token)")
    parser.add_argument("--port", type=int, default=8765, help="port (default %(default)s; 0 picks a free one)")
    parser.add_argument("--token", default=None,
                        help="require this token in every request (default: none on 127.0.0.1, a random one on any "
                             "other host)")
    parser.add_argument("--max-upload-mb", type=float, default=1024, metavar="MB",
                        help="largest image upload accepted (default %(default)g MB)")
    parser.add_argument("--max-megapixels", type=float, default=DEFAULT_MAX_PIXELS / 1e6, metavar="MPX",
                        help="largest image (or stack page) read, checked from the file's header before decoding "
                             "(default %(default).1f Mpx = 8192²; a file may hold 16 such images); also Pillow's "
                             "decompression-bomb limit in this process")
    parser.add_argument("--cache-gb", type=float, default=1.5, metavar="GB",
                        help="memory for cached features (default %(default)g GB, which keeps the server under "
                             "2.5 GB; a 1024² grey image takes 0.12 GB of classical features with the default "
                             "filter set; an image needing more than half the cache is featurised tile by tile)")
    parser.add_argument("--slice-folders", action="store_true",
                        help="each folder given is one volume of numbered slice files (TIFF, PNG, BMP), shown as "
                             "one entry with XY, XZ and YZ views; multi-page TIFF stacks and zarr with a z axis are "
                             "volumes without it")
    _add_backbone_arguments(parser, several=False)
    parser.add_argument("--seed", type=int, default=0, help="seed of a randomly initialised backbone")


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({err.strerror}): choose another --port or --host") from None
    return sock


def run(args) -> int:
    from PIL import Image

    from .options import parse_model_args
    from .segment import _check_backbone_weights

    if args.max_upload_mb <= 0 or args.cache_gb < 0 or args.max_megapixels <= 0:
        raise ValueError("--max-upload-mb and --max-megapixels must be positive and --cache-gb at least 0")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    backbone_kwargs = {}
    if args.backbone is None and args.checkpoint:
        raise ValueError("--checkpoint needs --backbone NAME")
    if args.backbone is not None:
        checkpoints = _check_backbone_weights(args, [args.backbone])
        backbone_kwargs = dict(checkpoint=checkpoints.get(args.backbone), model_kwargs=parse_model_args(args.model_arg),
                               pretrained=args.pretrained and args.backbone not in checkpoints, seed=args.seed)
    max_pixels = int(args.max_megapixels * 1e6)
    # Pillow refuses to decode past twice its limit (DecompressionBombError): tie it to the app's cap,
    # which the app checks itself from each file's header before decoding.
    previous, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, max_pixels
    try:
        return _serve(args, backbone_kwargs, max_pixels)
    finally:
        Image.MAX_IMAGE_PIXELS = previous


def _serve(args, backbone_kwargs: dict, max_pixels: int) -> int:
    import uvicorn

    from ..app.engine import Engine
    from ..app.server import create_app
    from ..app.session import Session
    from ..app.volume import Volumes

    from ..chunked import is_zarr_path

    volumes = Volumes(args.session, max_pixels)  # a volume given opens as one entry (the volume mode), not as pages
    slice_folders = [Path(s) for s in args.sources if args.slice_folders and Path(s).is_dir() and not is_zarr_path(s)]
    for folder in slice_folders:
        volumes.claim(folder, slice_folder=True)
    session = Session(args.session, [s for s in args.sources if Path(s) not in slice_folders],
                      allowed_roots=([args.out] if args.out is not None else []) + slice_folders,
                      max_pixels=max_pixels, volume_claim=volumes.claim)
    for reason in session.skipped:
        print(f"alibi-vit app: warning: {reason}", file=sys.stderr, flush=True)
    token = args.token or (None if args.host in LOCAL_HOSTS else secrets.token_urlsafe(24))
    engine = Engine(session, args.backbone, backbone_kwargs, cache_bytes=int(args.cache_gb * (1 << 30)),
                    out=args.out, device=args.device)
    sock = _listening_socket(args.host, args.port)
    port = sock.getsockname()[1]
    hosts = None if token else {f"{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]")}
    app = create_app(session, engine, token=token, max_upload_mb=args.max_upload_mb, hosts=hosts, volumes=volumes)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))

    def announce():
        while not server.started and not server.should_exit:
            threading.Event().wait(0.05)
        if server.started:
            print(f"alibi-vit app: serving at {url}", flush=True)
            print(f"alibi-vit app: session {session.folder} ({len(session.images)} images, "
                  f"{len(session.classes)} classes); Ctrl-C stops", file=sys.stderr, flush=True)

    threading.Thread(target=announce, daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
    return 0
