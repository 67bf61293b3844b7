"""The applications built on the ``posthoc`` library: the command line (``posthoc ...``), the demo, the loaders of
models and data sets named on the command line, and the Lightning callback.

They import only from ``posthoc``; ``posthoc`` never imports them (``tests/test_architecture.py`` enforces it).
"""
