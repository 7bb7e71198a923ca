"""The package version, on the ground floor so that the command line reads it without the face."""

__all__ = ["__version__"]

__version__ = "0.2.0"
