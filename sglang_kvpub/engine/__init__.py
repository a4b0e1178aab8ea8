"""The SGLang edge: the only package that names SGLang's classes (imported lazily, in SGLang processes)."""
