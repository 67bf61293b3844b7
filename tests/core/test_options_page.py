"""docs/options.md is generated from the methods' option dataclasses (tools/options_page.py) and kept current."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from posthoc.core.registry import method_class, method_names
from posthoc.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("options_page", ROOT / "tools" / "options_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_options_page_is_current():
    tool = _tool()
    assert tool.PAGE.read_text() == tool.page(), "docs/options.md is stale: run python tools/options_page.py"


def test_every_registered_method_has_a_section():
    text = (ROOT / "docs" / "options.md").read_text()
    for name in method_names():
        assert f"## `{name}`" in text


def test_literal_options_are_checked_by_their_dataclass():
    options = method_class("laplace").Options
    with pytest.raises(ConfigError, match=r"link must be one of \('probit', 'mc', 'bridge'\), got 'logit'"):
        options(link="logit")
    with pytest.raises(ConfigError, match="batch_size must be an integer of at least 2 or 'auto'"):
        method_class("mc-batchnorm").Options(batch_size="big")
    assert "'probit' | 'mc' | 'bridge'" in _tool().type_name(__import__("typing").get_type_hints(options)["link"])
