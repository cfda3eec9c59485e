"""A pytest plugin that runs one share of the collected tests: ``-p pytest_shard --shard I/N``.

benchmarks/gpu_suite.py starts N pytest processes side by side on a GPU machine, so that the
kernels the tests compile (several seconds each, cold) compile on N CPU cores at once. Test i of
the collection goes to share ``i mod N``: parametrised cases of one test, which compile similar
kernels, spread over all shares, and every test runs in exactly one share.
"""

from __future__ import annotations


def parse_shard(spec: str) -> tuple[int, int]:
    """``"I/N"`` → (I, N) with 0 <= I < N, or a ValueError naming the problem."""
    try:
        index, count = (int(part) for part in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like I/N (e.g. 0/4), got {spec!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"--shard {spec}: need 0 <= I < N")
    return index, count


def share(items: list, index: int, count: int) -> tuple[list, list]:
    """(kept, deselected): every ``count``-th item starting at ``index``, and the rest."""
    kept = [item for i, item in enumerate(items) if i % count == index]
    dropped = [item for i, item in enumerate(items) if i % count != index]
    return kept, dropped


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only share I of N (tests I, I+N, I+2N, ... of the collection)")


def pytest_configure(config):
    spec = config.getoption("--shard")
    if spec is not None:
        import pytest

        try:
            parse_shard(spec)
        except ValueError as err:
            raise pytest.UsageError(str(err)) from None


def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if spec is None:
        return
    kept, dropped = share(items, *parse_shard(spec))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
