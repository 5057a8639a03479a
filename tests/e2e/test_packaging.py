"""Plugins depend on a range of rlx releases: the contrib plugins and the scaffold's packages declare one that
holds the rlx installed here and stops before the next release that may change the plugin API."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest

from rlx.cli.scaffold import rlx_requirement

tomllib = pytest.importorskip("tomllib")
requirements = pytest.importorskip("packaging.requirements")
ROOT = Path(__file__).resolve().parents[2]


def rlx_dependency(pyproject: Path):
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    (req,) = [r for r in map(requirements.Requirement, deps) if r.name == "rlx"]
    return req


@pytest.mark.parametrize("plugin", sorted(p.name for p in (ROOT / "contrib").iterdir() if p.is_dir()))
def test_contrib_plugins_depend_on_a_range_holding_this_rlx(plugin):
    req = rlx_dependency(ROOT / "contrib" / plugin / "pyproject.toml")
    assert req.specifier.contains(version("rlx"), prereleases=True), (plugin, str(req))
    assert any(s.operator == "<" for s in req.specifier), f"{plugin}: no upper bound in {req}"
    assert not req.specifier.contains("1000.0"), str(req)


def test_scaffold_range_ends_at_the_next_release_that_may_change_the_plugin_api():
    assert rlx_requirement("0.1.0") == "rlx>=0.1.0,<0.2"
    assert rlx_requirement("0.12.3.dev1") == "rlx>=0.12.0,<0.13"
    assert rlx_requirement("1.4.2") == "rlx>=1.4.0,<2"
    here = requirements.Requirement(rlx_requirement())
    assert here.specifier.contains(version("rlx"), prereleases=True)
