"""The models the examples train and serve and `bench --workload` measures: `llama` (a Llama-style decoder
built as pipeline stages, grouped-query attention, KV cache) and `vit` (a Vision Transformer and synthetic
images). Plain torch; importing this package imports neither."""
