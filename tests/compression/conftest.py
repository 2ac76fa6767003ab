"""Run the Triton kernels in the interpreter on CPU tensors when there is no CUDA device.

The variable must be set before Triton decorates the kernels, so it is set here, before any
test module imports `zoo_gym.compression.kernels`.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
