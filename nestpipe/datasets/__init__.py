"""Dataset schemas (KuaiRand), the synthetic generator, and the training-shard format."""
