import pytest
import torch

import torch_offload  # noqa: F401  (loads the ops)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
