"""models: the Transformer zoo written in namedmesh (issue 6).

`models.load(path, mesh=None, layout=None)` (models/inference/api.py) loads a Hugging Face folder
or a training run as a model that generates and scores text, `models.Sampling` how its
`.generate` draws tokens; each is imported on first use, so that `import models.architecture`
stays light."""

__all__ = ["Sampling", "load"]


def __getattr__(name: str):
    if name == "load":
        from models.inference.api import load

        return load
    if name == "Sampling":
        from models.inference.sampling import Sampling

        return Sampling
    raise AttributeError(f"module 'models' has no attribute {name!r}")
