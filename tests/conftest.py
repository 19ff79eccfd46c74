import os

# Before torch/transformers/triton import anywhere in the test session.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402  (importing torch does not import triton)

# Without a GPU, Triton kernels run through the interpreter (fp32/fp16 only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Fixtures several test files share (after the environment above is set).
from tests.batch_helpers import batch_model  # noqa: E402, F401
