"""The package version (the floor: every module may import it; ``ckptfmt.__version__`` re-exports it)."""
__version__ = "0.1.0"
