"""Model families behind one interface: `base` (what a family provides: a CPU processor and a device model),
`catalog` (the registry: which family a checkpoint is, loading it), one package per family, and the tiny
random-weight checkpoints (`tiny`). Importing this package imports nothing heavy."""
