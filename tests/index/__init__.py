"""Block keys and the prefix index: hashing, the index and its C walks, residency, tree cores, Dynamo's index."""
