"""A memory-bounded cache of computed features, keyed by the pixels they were computed from.

Interactive use trains and predicts again after every stroke on images whose features do not
change; :class:`FeatureCache` lets :class:`~alibi_vit.trainable.TrainableSegmenter` compute the
classical features of each tile and the ViT patch features of each image once. Keys are digests
of the scaled pixels (plus what else the features depend on), so a cached entry can never be
served for other pixels or other settings; the least recently used entries go first when the
total size passes ``max_bytes``.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np

__all__ = ["FeatureCache", "array_digest"]


def array_digest(array: np.ndarray, *context) -> str:
    """A digest of ``array``'s dtype, shape and bytes, and of ``context`` (settings the value depends on)."""
    array = np.ascontiguousarray(array)
    h = hashlib.blake2b(digest_size=20)
    h.update(repr((array.dtype.str, array.shape, context)).encode())
    h.update(memoryview(array).cast("B"))
    return h.hexdigest()


class FeatureCache:
    """Least-recently-used arrays, at most ``max_bytes`` in all (an entry larger than that is not kept).

    Thread-safe; the computation runs outside the lock, so two threads asking for the same missing
    key may both compute it (the result is the same)."""

    def __init__(self, max_bytes: int = 2 << 30):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._items: OrderedDict[str, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def get(self, key: str, compute):
        """The array stored under ``key``, computed by ``compute()`` and stored when missing."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
            self.misses += 1
        value = compute()
        self.put(key, value)
        return value

    def put(self, key: str, value: np.ndarray) -> None:
        size = int(value.nbytes)
        with self._lock:
            if key in self._items:
                self._bytes -= int(self._items.pop(key).nbytes)
            if size > self.max_bytes:
                return
            self._items[key] = value
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= int(old.nbytes)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
