"""The SGLang side: the plugin, its hooks and guard, HBM release, reconciliation, cache-aware dispatch."""
