"""Subprocess helpers for the torch bridge tests: launch N gloo ranks running a named scenario."""
