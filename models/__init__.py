"""models: the Transformer zoo written in namedmesh (issue 6)."""
