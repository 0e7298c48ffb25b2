"""Where items come from: paths, folders, globs, URLs, manifests, tar shards and prompt sets, each item with a
stable key; and which items a shard of a split run takes."""
