"""Where bytes become model inputs: the pool of worker processes that decode and preprocess items (killable:
a crash or a hang costs one item), the fork server they start from, and the lane that streams tar members."""
