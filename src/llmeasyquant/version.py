"""The package version, in a leaf module so that records can name it without importing the package's face."""

__version__ = "0.1.0"
