"""The wire contract: encodings, decoding of every shape in the wild, fuzzed input, per-rank order, removal reasons."""
