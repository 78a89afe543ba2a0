"""models: the Transformer zoo written in namedmesh (issue 6).

`models.load(path, mesh=None, layout=None)` (models/api.py) loads a Hugging Face folder
or a training run as a model that generates and scores text; it is imported on first
use, so that `import models.config` stays light."""

__all__ = ["load"]


def __getattr__(name: str):
    if name == "load":
        from models.api import load

        return load
    raise AttributeError(f"module 'models' has no attribute {name!r}")
