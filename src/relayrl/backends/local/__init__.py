"""In-process PyTorch backend: collation of packed micro-batches, log-prob computation, and the
local trainer/sampler built on a Hugging Face causal LM."""
