"""On a CUDA device: the estimate against the allocator, and memtrain against Unsloth."""
