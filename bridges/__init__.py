"""Framework bridges for ckptfmt.

Each bridge imports its framework (``bridges.jax`` imports jax, ``bridges.flax`` imports flax),
so this package imports nothing: ``import bridges`` never pulls in a framework.
"""
