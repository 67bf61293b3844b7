"""MC dropout: ``sites`` (where dropout acts), ``masks`` (drawing and applying them), ``shared_masks``
(head dropout with one mask per sample for the whole batch) and ``method`` (the registered method)."""

from posthoc.methods.mc_dropout import method  # noqa: F401
