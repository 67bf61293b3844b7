"""The ``posthoc`` command line."""
