"""``rlx plugins new reward NAME``: write a ready-to-install reward plugin package.

The package has a ``pyproject.toml`` with the ``rlx`` entry point, a module with an options model,
the reward function and its ``@hookimpl``, a README, and tests that pass as generated (``pytest``
inside the folder). ``pip install ./rlx-reward-NAME`` makes ``rlx train --reward NAME`` use it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from rlx.errors import UserError

KINDS = ("reward",)
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "The {name} reward for rlx"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["{rlx_requirement}", "pydantic>=2.6"]

# The whole integration with rlx: this entry point in the `rlx` group.
[project.entry-points.rlx]
{name} = "{module}"

[tool.setuptools]
packages = ["{module}"]

[tool.pytest.ini_options]
testpaths = ["tests"]

[tool.ruff]
line-length = 120
'''

MODULE = '''\
"""``{name}``: a reward for rlx.

Scores each response against the row's ground truth: ``exact_score`` when the response (stripped)
is the ground truth, ``contains_score`` when it contains it, else 0.0. ``{name}/exact`` is logged
beside the score (as ``reward/{name}/exact`` in metrics.jsonl).

Replace ``score`` with your own rule; keep ``build`` and ``rlx_rewards``. The reward function gets a
:class:`rlx.protocols.RewardBatch` (``prompts``, ``responses``, ``ground_truths``, ``data_sources``,
``extra_infos``, ``response_lengths``: one entry per response) and returns one score per response.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from rlx import Component, hookimpl
from rlx.protocols import RewardBatch, RewardOutput


class {cls}Options(BaseModel):
    """Set as reward.KEY=VALUE, e.g. `rlx train --reward {name} reward.contains_score=0.2`."""

    model_config = ConfigDict(extra="forbid")
    exact_score: float = Field(1.0, description="Score when the response is exactly the ground truth.")
    contains_score: float = Field(0.5, description="Score when the response contains the ground truth.")
    case_sensitive: bool = Field(False, description="Compare with case.")


def score(response: str, ground_truth: Any, opts: {cls}Options) -> float:
    truth, text = str(ground_truth).strip(), response.strip()
    if not opts.case_sensitive:
        truth, text = truth.lower(), text.lower()
    if text == truth:
        return opts.exact_score
    if truth and truth in text:
        return opts.contains_score
    return 0.0


def build(options: {cls}Options | None, ctx: Any) -> Any:
    """Called once by rlx with the validated options; returns the reward function."""
    opts = options or {cls}Options()

    def {module}(batch: RewardBatch) -> RewardOutput:
        scores = [score(r, t, opts) for r, t in zip(batch.responses, batch.ground_truths, strict=True)]
        return RewardOutput(scores, {{"{name}/exact": [float(s == opts.exact_score) for s in scores]}})

    return {module}


@hookimpl
def rlx_rewards() -> list[Component]:
    return [Component(kind="reward", name="{name}", factory=build, config_model={cls}Options,
                      summary="Exact or contained match of the ground truth.")]
'''

TEST = '''\
"""Tests of the {name} reward, installed or straight from this folder: run `pytest` here."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from rlx.protocols import RewardBatch, RewardOutput
from rlx.registry import PluginManager

ROOT = Path(__file__).resolve().parents[1]
try:
    plugin = importlib.import_module("{module}")
except ImportError:  # not installed: use the source folder
    sys.path.insert(0, str(ROOT))
    plugin = importlib.import_module("{module}")


def batch(responses: list[str], truths: list[str]) -> RewardBatch:
    n = len(responses)
    return RewardBatch(["q"] * n, responses, truths, ["test"] * n, [{{}}] * n, [len(r) for r in responses])


def test_scores_exact_contained_and_wrong():
    fn = plugin.build(plugin.{cls}Options(), None)
    out = fn(batch(["7", " The answer is 7.", "8", "SEVEN"], ["7", "7", "7", "seven"]))
    assert isinstance(out, RewardOutput)
    assert out.scores == [1.0, 0.5, 0.0, 1.0]
    assert out.extra == {{"{name}/exact": [1.0, 0.0, 0.0, 1.0]}}


def test_options_are_checked():
    assert plugin.score("SEVEN", "seven", plugin.{cls}Options(case_sensitive=True)) == 0.0
    with pytest.raises(ValidationError):
        plugin.{cls}Options(no_such_option=1)
    assert all(f.description for f in plugin.{cls}Options.model_fields.values())


def test_registered_under_its_name():
    pm = PluginManager()
    pm.register(plugin, name="{name}", distribution="{dist}", version="0.1.0")
    comp = pm.get("reward", "{name}")
    assert comp.load_config_model() is plugin.{cls}Options
    fn = comp.load_factory()(comp.load_config_model()(), None)
    assert fn(batch(["7"], ["7"])).scores == [1.0]


def test_runs_under_the_reward_worker_contract():
    """rlx runs every reward through a runner that checks one finite score per response."""
    from rlx.run.rewards import RewardRunner

    runner = RewardRunner(plugin.build(None, None), "{name}")
    out = runner.run(batch(["a", "b", "c"], ["a", "x", "c"]))
    assert out.scores == [1.0, 0.0, 1.0] and out.failures == []


def test_pyproject_declares_the_entry_point_and_supports_the_installed_rlx():
    """Run these tests under each rlx release the range admits (rlx's docs/plugins.md): under an rlx outside
    it, this test fails."""
    from importlib.metadata import version

    tomllib = pytest.importorskip("tomllib")
    requirements = pytest.importorskip("packaging.requirements")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["rlx"] == {{"{name}": "{module}"}}
    (rlx_req,) = [r for r in map(requirements.Requirement, meta["project"]["dependencies"]) if r.name == "rlx"]
    installed = version("rlx")
    assert str(rlx_req.specifier) and rlx_req.specifier.contains(installed, prereleases=True), (installed, rlx_req)
'''

README = '''\
# {dist}

An rlx reward plugin: `{name}` scores each response against the row's
ground truth (exact match, or the ground truth contained in the response).

```bash
pip install -e .                 # or: pip install . ; pip wheel . for a wheel to publish
pytest                           # the tests in tests/
rlx plugins show {name}          # its options
rlx train --reward {name} data.train_files=... model.path=...
```

Scores appear in `metrics.jsonl` as `reward/mean` and `reward/{name}/exact`. Edit `score()` in
`{module}/__init__.py` for your own rule. See rlx's `docs/plugins.md` for writing, testing and
publishing plugins.
'''


def new_plugin(
    kind: Annotated[str, typer.Argument(help="What to make: reward.")],
    name: Annotated[str, typer.Argument(help="The component's name, e.g. exact_match (letters, digits, _).")],
    out: Annotated[str, typer.Option("--out", "-o", help="Folder to create the package in.")] = ".",
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing package folder.")] = False,
) -> None:
    """Write a ready-to-install plugin package (pyproject, module, tests) that `pip install` adds to rlx."""
    path = write_package(kind, name, Path(out), force=force)
    typer.echo(f"Wrote {path}/")
    for f in sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file()):
        typer.echo(f"  {f}")
    typer.echo(f"Next: cd {path} && pytest && pip install -e . && rlx train --reward {name} ...")


def rlx_requirement(version: str | None = None) -> str:
    """The rlx versions a new plugin supports: from this release to the next one that may change the plugin
    API (the next minor release before 1.0, the next major after), e.g. ``rlx>=0.1.0,<0.2``."""
    from rlx import __version__

    parts = [int(p) for p in re.findall(r"\d+", version or __version__)[:2]] + [0]
    major, minor = parts[0], parts[1]
    upper = f"{major}.{minor + 1}" if major == 0 else f"{major + 1}"
    return f"rlx>={major}.{minor}.0,<{upper}"


def write_package(kind: str, name: str, out: Path, *, force: bool = False) -> Path:
    """Create ``out/rlx-reward-<name>/`` and return its path."""
    from rlx.errors import did_you_mean

    if kind not in KINDS:
        raise UserError(f"Cannot make a plugin of kind {kind!r}.{did_you_mean(kind, KINDS)} "
                        f"Kinds: {', '.join(KINDS)}.")
    if not _NAME.match(name):
        raise UserError(f"{name!r} is not a usable name: use letters, digits and _, starting with a letter "
                        "(e.g. exact_match).")
    from rlx.registry import get_plugin_manager

    pm = get_plugin_manager()
    taken = pm.components().get(("reward", name))
    if taken is not None:
        raise UserError(f"A reward named {name!r} is already installed (from {taken.distribution}); two would "
                        "clash.", "Choose another name.")
    # The package's entry point is named after the reward; two distributions with one entry-point name clash.
    owner = next((p for p in pm.plugins if p.name == name), None)
    if owner is not None:
        raise UserError(f"The rlx plugin entry point name {name!r} is already used by {owner.distribution}; two "
                        "would clash.", "Choose another name.")
    module = f"rlx_reward_{name.lower()}"
    dist = f"rlx-reward-{name.lower().replace('_', '-')}"
    cls = "".join(part.capitalize() for part in name.split("_"))
    target = out.expanduser() / dist
    if target.exists() and not force:
        raise UserError(f"{target} already exists.", "Pass --force to overwrite it, or --out another folder.")
    values = {"name": name, "module": module, "dist": dist, "cls": cls, "rlx_requirement": rlx_requirement()}
    files = {
        "pyproject.toml": PYPROJECT, "README.md": README, f"{module}/__init__.py": MODULE,
        f"tests/test_{name.lower()}.py": TEST,
    }
    for rel, template in files.items():
        p = target / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(template.format(**values), encoding="utf-8")
    return target
