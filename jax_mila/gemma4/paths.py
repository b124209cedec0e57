"""Where the shipped model cards and the embedded checkpoint live.

A wheel installs ``models/`` as ``jax_mila/models`` (CMakeLists.txt); a source checkout keeps
it at ``<repo>/models``. One helper finds either.
"""

from __future__ import annotations

import pathlib

import jax_mila

EMBEDDED = "embedded"


def models_dir() -> pathlib.Path:
    """The directory holding ``<size>/config.json`` cards and ``embedded/``."""
    package = pathlib.Path(jax_mila.__file__).resolve().parent
    for candidate in (package / "models", package.parent / "models"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no models/ directory next to {package} "
                            "(installed: jax_mila/models; source checkout: <repo>/models)")


def embedded_checkpoint() -> pathlib.Path:
    """The small random-weight checkpoint used by the CLI and tests by default."""
    return models_dir() / EMBEDDED


def model_card(size: str) -> pathlib.Path:
    """config.json of a released size (e.g. "e2b", "31b", "12b")."""
    path = models_dir() / size / "config.json"
    if not path.is_file():
        sizes = sorted(p.name for p in models_dir().iterdir() if (p / "config.json").is_file())
        raise FileNotFoundError(f"no model card for {size!r} (available: {sizes})")
    return path
