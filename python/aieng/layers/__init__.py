"""Model building blocks. Each op is one function with a pure-PyTorch reference body, so a
faster backend (CUDA kernels) can replace it without touching the model files."""
