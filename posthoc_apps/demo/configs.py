"""The demo's rows: which configurations of which registered methods ``posthoc demo`` fits and compares.

One table keyed by method name, in the order the rows appear (the plain model, ``auto`` (the method the
selection step picks on held-out data, which the demo's verdict recommends) and temperature scaling first). Each
entry is ``(label, options)``; the options may mix wrap and fit options,
and a stacking method may name the methods it stacks on with ``"on"`` (e.g.
``("Laplace + DAC", {"on": ["laplace"]})``, the inner methods with their defaults).

Example:
    >>> from posthoc_apps.demo.configs import DEMO_CONFIGS
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

#: the rows ``posthoc demo`` leaves out unless told ``--all`` (or asked for their method with ``--method``), so that it
#: runs in about two minutes on 2 CPU cores: the costliest rows, and those that predict nearly as another row does
#: (their CPU seconds on the demo, measured with ``--all``, are in CHANGELOG.md); the report names them
LEFT_OUT: frozenset[str] = frozenset(
    {"iBNN (K=2)", "LLLA full", "LLLA diag", "MC dropout (head, p=auto)", "SWAG", "Laplace + DAC"}
)

#: the seconds each step takes on 2 quiet CPU cores (about its CPU seconds over 1.3; ``None``: a row not listed): what
#: the progress bar's ETA is made of, so that it follows the work left rather than the count of steps
EXPECTED_SECONDS: dict[str | None, float] = {
    "digits, checkpoint and OOD scores": 4.0,
    "MAP": 4.0,
    "auto": 30.0,
    "temperature": 3.0,
    "iBNN (K=2)": 47.0,
    "LLLA kron": 16.0,
    "LLLA full": 11.0,
    "LLLA diag": 8.0,
    "MC dropout (own, rate on val)": 11.0,
    "MC dropout (head, p=auto)": 28.0,
    "SWAG": 40.0,
    "SWAG last-layer": 13.0,
    "VI (head)": 8.0,
    "DAC": 26.0,
    "Laplace + DAC": 43.0,
    "verdict, plots and report": 12.0,
    None: 10.0,
}
#: the seconds of a ``+ temperature`` row (the temperature chosen on the calibration digits, then evaluated)
TEMPERATURE_SECONDS = 20.0
