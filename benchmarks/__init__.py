"""Performance measurements of jaxres (see ``python -m benchmarks``)."""
