"""The worker side of a step: KV tensors, the model runner, sampling."""
