"""What to load and whether it fits: model references resolved to checkpoints (the demo and tiny models
built on first use), devices and dtypes, and the memory check before loading."""
