"""Memory of trainable segmentation where issue 19 set bounds (2-core CPU: the numbers in docs/segmentation.md and docs/method.md §7).

    python benchmarks/bench_trainable_memory.py           # four fully labelled 2048² images; 4096² with crf
    python benchmarks/bench_trainable_memory.py --smoke   # small sizes, checks the script works

train: fit() on --count synthetic 16-bit images of --train-size px with *every* pixel labelled
(classical features, max_samples 500 000): peak memory above the baseline (target ≤ 4 GB).
crf: predict() of one --crf-size image with crf="paper" (tiled CRF) (target ≤ 3 GB).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trainable_seg import PeakMemory, predict_memory  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-size", type=int, default=2048)
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--crf-size", type=int, default=4096)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.train_size, args.count, args.crf_size = 128, 2, 256
    from alibi_vit.trainable import TrainableSegmenter, scribbles, synthetic_micrograph

    pairs = [synthetic_micrograph(args.train_size, seed=s) for s in range(args.count)]
    images, masks = [q[0] for q in pairs], [q[1] for q in pairs]  # every pixel labelled
    seg = TrainableSegmenter(classifier_params={"n_jobs": 2})
    t = time.perf_counter()
    with PeakMemory() as mem:
        seg.fit(images, masks)
    print(f"train: {args.count} fully labelled {args.train_size}² images ({sum(m.size for m in masks)} labelled "
          f"pixels): {mem.above / 2**30:.2f} GB above baseline, {time.perf_counter() - t:.0f} s", flush=True)
    image, mask = synthetic_micrograph(512, seed=1)
    seg = TrainableSegmenter(crf="paper", classifier_params={"n_jobs": 2}).fit([image], [scribbles(mask, 3, rng=0)])
    res = predict_memory(seg, args.crf_size)
    print(f"crf: predict {args.crf_size}² with crf='paper': {res['above_baseline_gb']:.2f} GB above baseline, "
          f"{res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
