"""Training a small Llama-architecture language model from scratch (`aieng train`)."""
