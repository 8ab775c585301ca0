"""Runnable examples (``python examples/demo.py``, ``torchrun examples/elastic_train.py``):
a package only so that the import contracts and mypy see them (pyproject.toml)."""
