import os

import torch

# Triton reads TRITON_INTERPRET when it is first imported: without a GPU its kernels run on the
# CPU interpreter, which is how CI checks the fused kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, os.cpu_count() or 1))
