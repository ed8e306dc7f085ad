"""The model as data: ModelConfig (config.py), the weight maps from Hugging Face names (weights.py), the
forward pass over a parameter pytree (transformer.py) and the paged KV cache pytree (kv_cache.py)."""
