"""The device side: workers, each with a model runner and a sampler."""
