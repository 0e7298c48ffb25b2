"""Model families behind one interface: `base` (what a family provides: a CPU processor and a device model),
`catalog` (the registry: the known families, which one a checkpoint's config.json names), `loading` (a
checkpoint loaded with its family), one package per family, and the tiny random-weight checkpoints (`tiny`).
Importing this package imports nothing heavy."""
