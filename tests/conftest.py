import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported: without a GPU its kernels run on the
# CPU interpreter, which is how CI checks the fused kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """An empty Hugging Face cache and a hub that cannot be reached; timm must never start a download."""
    import huggingface_hub
    import timm.models._hub as timm_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    calls = []

    def unreachable(url, *args, **kwargs):
        calls.append(url)
        raise OSError("[Errno -2] Name or service not known")  # what a machine without DNS answers

    def no_download(*args, **kwargs):
        raise AssertionError("timm tried to download although the weights cannot be had")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", unreachable)
    monkeypatch.setattr(timm_hub, "hf_hub_download", no_download)
    return calls


@pytest.fixture
def one_thread():
    """BLAS and OpenMP pools at one thread, torch's included (faiss's OpenMP calls can run on torch's runtime, which
    torch sets to its own thread count at its first parallel operation). OpenMP threads busy-wait at every barrier:
    on a loaded 2-core machine the tests' tiny k-means runs took 10-50x longer with two threads than with one."""
    import faiss  # noqa: F401  (threadpoolctl limits only the libraries already loaded)
    import sklearn.cluster  # noqa: F401
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(1):
            yield
    finally:
        torch.set_num_threads(threads)
