"""The bits of posthoc every layer relies on: the method contract, registry, predictions, inputs, errors, settings."""
