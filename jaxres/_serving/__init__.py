"""Serving: saved models of trained objects (``jr.saved_model``)."""
