"""Building models from short specs and reading image folders with the model's own preprocessing."""
