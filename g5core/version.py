"""The version of G5 (a module of its own: the core reads it without importing the package facade)."""
__version__ = "0.1.0"
