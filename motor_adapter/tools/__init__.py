"""``motor-kv-adapter`` and its subcommands, and Motor's coordinator launcher (a dev and test tool)."""
