"""The errors that several modules of models/ raise, defined here, below them all, so
that a module raising one imports nothing that imports it back (issue 42: rope.py and
latent.py raised config.py's ConfigError, and config.py holds their records; datasets.py
raised data.py's DataError, and data.py reads through datasets.py). Each is re-exported
where it was defined: `models.architecture.ConfigError` and `models.training.data.DataError` still
are."""

from namedmesh.errors import ParameterError


class ConfigError(ParameterError):
    """A Config whose options contradict each other or name no known choice, or a
    `--set field=value` that names no Config field or whose value has the wrong type
    (a ParameterError, so a NamedMeshError and a ValueError)."""


class UnknownConfigError(ConfigError, KeyError):
    """A config name the catalog does not know: a ConfigError, and a KeyError for callers
    that look names up; its message reads as written (a KeyError's str quotes it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DataError(ValueError):
    """Bad data path, empty corpus, or a corpus too short for the sequence length."""
