"""The device boundary: the `Worker` and its `ModelRunner` (the forward over the paged KV cache,
input buffers, CUDA graphs), the sampler and its helpers, prompt logprobs, the embedding pooler,
speculative verification and the draft model, the KV cache spec, device and host memory."""
