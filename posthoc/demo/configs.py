"""The demo's rows: which configurations of which registered methods ``posthoc demo`` fits and compares.

One table keyed by method name, in the order the rows appear (the plain model, ``auto`` (the method the
selection step picks on held-out data, which the demo's verdict recommends) and temperature scaling first). Each
entry is ``(label, options)``; the options may mix wrap and fit options,
and a stacking method may name the methods it stacks on with ``"on"`` (e.g.
``("Laplace + DAC", {"on": ["laplace"]})``, the inner methods with their defaults).

Example:
    >>> DEMO_CONFIGS["laplace"][0]
    ('LLLA kron', {'hessian': 'kron'})
"""

from __future__ import annotations

from typing import Any

#: per registered method name, its demo rows ``(label, options)``
DEMO_CONFIGS: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    "none": (("MAP", {}),),
    "auto": (("auto", {}),),
    "temperature": (("temperature", {}),),
    "ibnn": (("iBNN (K=2)", {}),),
    "laplace": (
        ("LLLA kron", {"hessian": "kron"}),
        ("LLLA full", {"hessian": "full"}),
        ("LLLA diag", {"hessian": "diag"}),
    ),
    "mc-dropout": (
        ("MC dropout (own, rate on val)", {}),
        ("MC dropout (head, p=auto)", {"where": "head", "p": "auto"}),
    ),
    "swag": (
        ("SWAG", {"epochs": 2, "lr": 0.05, "collect_per_epoch": 4, "num_samples": 8}),
        ("SWAG last-layer", {"subset": "last_layer", "epochs": 3, "lr": 0.05, "collect_per_epoch": 4}),
    ),
    "vi": (("VI (head)", {}),),
    "dac": (("DAC", {}), ("Laplace + DAC", {"on": ["laplace"]})),
}
