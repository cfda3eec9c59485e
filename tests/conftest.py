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
    """BLAS and OpenMP pools (faiss's, scikit-learn's) at one thread: their threads busy-wait at every barrier, so on
    a loaded 2-core machine the tests' tiny k-means runs took 10-100x longer with two threads than with one."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        yield
