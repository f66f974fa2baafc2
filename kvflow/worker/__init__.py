"""The worker: model runner, persistent batch, KV cache tensors, executor."""
