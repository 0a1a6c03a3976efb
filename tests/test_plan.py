"""`channelsmith plan`: renders every recipe offline and shows which compiles are shared."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from channelsmith.errors import RecipeError, VariantError
from channelsmith.plan import make_plan
from conftest import SITES
from channelsmith.recipes import list_recipes, render_recipe, select_recipes

REPO = Path(__file__).resolve().parents[1]

STAGED_RECIPE = """\
context:
  version: ${{ lib_version }}
recipe:
  name: toy
  version: ${{ version }}
source:
  - if: lib_version == "1.0"
    then:
      path: ../../src
      patches:
        - ../../patches/toy/1.0/fix/0001-fix.patch
build:
  number: 0
outputs:
  - staging:
      name: toy-compile
    requirements:
      build:
        - ${{ compiler('cxx') }}
    build:
      script:
        - echo compile
  - package:
      name: libtoy
    inherit: toy-compile
    build:
      string: ${{ site }}_h${{ hash }}_0
    tests:
      - script:
          - "true"
  - package:
      name: py-toy
    inherit: toy-compile
    requirements:
      host:
        - python
        - ${{ pin_subpackage('libtoy', exact=True) }}
    build:
      string: py${{ python | version_to_buildstring }}_${{ site }}_h${{ hash }}_0
about:
  license: MIT
"""

PATCH = """\
What: a toy fix
Why: tests
Upstream: none
Versions: 1.0
---
--- a/f.txt
+++ b/f.txt
@@ -1 +1 @@
-a
+b
"""


def make_repo(tmp_path: Path, recipe_text: str = STAGED_RECIPE, variants: str = 'lib_version: ["1.0", "2.0"]\n') -> Path:
    """A throwaway repository root: the real shared matrix plus one toy recipe."""
    root = tmp_path / "repo"
    (root / "recipes" / "toy").mkdir(parents=True)
    shutil.copy(REPO / "conda_build_config.yaml", root / "conda_build_config.yaml")
    (root / "recipes" / "toy" / "recipe.yaml").write_text(recipe_text)
    (root / "recipes" / "toy" / "variants.yaml").write_text(variants)
    patch = root / "patches" / "toy" / "1.0" / "fix" / "0001-fix.patch"
    patch.parent.mkdir(parents=True)
    patch.write_text(PATCH)
    (root / "src").mkdir()
    (root / "src" / "f.txt").write_text("a\n")
    return root


def run_cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "channelsmith", "--root", str(root), *args],
        capture_output=True, text=True, check=False,
    )


def test_plan_shares_one_staging_compile_across_python_versions(tmp_path: Path) -> None:
    plan = make_plan(make_repo(tmp_path), ["toy"])
    (recipe,) = plan.recipes
    # 2 versions x the sites; the engine compiles the staging output once per inheriting output name
    # (libtoy, py-toy), and every Python version of py-toy reuses that compile.
    assert len(recipe.compiles) == 2 * len(SITES) * 2
    for compile_ in recipe.compiles:
        assert compile_.kind == "staging"
        assert "python" not in compile_.variant
        assert len(compile_.outputs) == (3 if "for py-toy" in compile_.name else 1)
    py_rows = [r for r in recipe.rows if r.package == "py-toy"]
    assert len(py_rows) == 2 * len(SITES) * 3
    assert {r.distinguishing["python"] for r in py_rows} == {"3.10", "3.11", "3.12"}


def test_plan_counts_patches_per_version(tmp_path: Path) -> None:
    plan = make_plan(make_repo(tmp_path), ["toy"])
    patches = {r.distinguishing["lib_version"]: r.patches for r in plan.recipes[0].rows}
    assert patches == {"1.0": 1, "2.0": 0}


def test_plan_variant_override_narrows_matrix(tmp_path: Path) -> None:
    plan = make_plan(make_repo(tmp_path), ["toy"], {"site": "derecho", "lib_version": "2.0"})
    rows = plan.recipes[0].rows
    assert {r.build_string.split("_")[-3] for r in rows if r.package == "libtoy"} == {"derecho"}
    assert len(rows) == 4


def test_plan_json_lists_every_package(tmp_path: Path) -> None:
    result = run_cli(make_repo(tmp_path), "plan", "toy", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    # Per version and site: libtoy, py-toy for 3 Pythons; 2 staging compiles.
    assert document["packages"] == 2 * len(SITES) * 4
    assert document["heavy_compiles"] == 2 * len(SITES) * 2


def test_unknown_recipe_exits_2_with_known_names(tmp_path: Path) -> None:
    result = run_cli(make_repo(tmp_path), "plan", "nosuch")
    assert result.returncode == 2
    assert "unknown recipe 'nosuch'" in result.stderr
    assert "toy" in result.stderr


def test_unknown_variant_key_exits_2(tmp_path: Path) -> None:
    root = make_repo(tmp_path)
    with pytest.raises(VariantError, match="unknown variant key 'colour'"):
        make_plan(root, ["toy"], {"colour": "red"})
    result = run_cli(root, "plan", "toy", "--variant", "colour=red")
    assert result.returncode == 2
    assert "known keys" in result.stderr


def test_variant_value_not_in_matrix_exits_2(tmp_path: Path) -> None:
    result = run_cli(make_repo(tmp_path), "plan", "toy", "--variant", "site=mars")
    assert result.returncode == 2
    assert "site=mars" in result.stderr and "derecho" in result.stderr


def test_malformed_variant_exits_2(tmp_path: Path) -> None:
    result = run_cli(make_repo(tmp_path), "plan", "toy", "--variant", "site")
    assert result.returncode == 2
    assert "KEY=VALUE" in result.stderr


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    broken = STAGED_RECIPE.replace("build:\n  number: 0", "build:\n number: [0", 1)
    root = make_repo(tmp_path, broken)
    with pytest.raises(RecipeError) as info:
        render_recipe(root, select_recipes(root, ["toy"])[0])
    assert "recipe.yaml:" in info.value.message
    result = run_cli(root, "plan", "toy")
    assert result.returncode == 2
    assert "YAML syntax error" in result.stderr and "recipe.yaml:1" in result.stderr


def test_every_repository_recipe_renders_offline() -> None:
    recipes = list_recipes(REPO)
    assert recipes, "the repository has no recipes"
    plan = make_plan(REPO)
    by_name = {r.recipe: r for r in plan.recipes}
    for recipe in recipes:
        assert by_name[recipe.name].rows, f"{recipe.name} renders no package"


def test_site_env_is_planned_as_offline_build() -> None:
    plan = make_plan(REPO, ["site-env"])
    names = {row.package for row in plan.recipes[0].rows}
    assert {"site-env-derecho", "site-env-docker-host", "site-env-generic"} <= names
    assert plan.recipes[0].offline


def test_the_packages_table_lists_compiles_in_number_order() -> None:
    # nccl builds twelve compiles (C1 ... C12): C10 comes after C9, not after C1.
    result = run_cli(REPO, "plan", "nccl")
    assert result.returncode == 0, result.stderr
    table = result.stdout.split("heavy compiles")[0]
    shown = list(dict.fromkeys(re.findall(r"nccl#C(\d+)", table)))
    assert len(shown) >= 10 and shown == sorted(shown, key=int), shown


COUNTED_RECIPE = """\
schema_version: 1
recipe:
  name: counted
  version: "1.0"
outputs:
  - staging:
      name: counted-compile
    build:
      script:
        - echo compiled >> {counter}
        - echo tree > built-tree.txt
  - package:
      name: libcounted
    inherit: counted-compile
    build:
      variant:
        ignore_keys: [python]
      script:
        - test -f built-tree.txt
        - mkdir -p $PREFIX/lib && echo lib > $PREFIX/lib/libcounted.txt
  - package:
      name: py-counted
    inherit: counted-compile
    build:
      string: py${{{{ python | version_to_buildstring }}}}_h${{{{ hash }}}}_0
      script:
        - test -f built-tree.txt
        - mkdir -p $PREFIX/share && echo py > $PREFIX/share/py-counted.txt
"""


def test_the_plans_heavy_compiles_are_the_staging_runs_the_engine_makes(tmp_path: Path) -> None:
    """py-rattler-build 0.73 runs a staging compile once per output name that inherits it (libtorch
    and pytorch: two), and reuses it for every Python of one name; the plan counts exactly those runs.
    An output that does not inherit gets no build tree at all (docs/reference/recipes.md, "Shared compiles")."""
    from channelsmith.build import build

    root = tmp_path / "repo"
    (root / "recipes" / "counted").mkdir(parents=True)
    (root / "conda_build_config.yaml").write_text('python:\n  - "3.10"\n  - "3.11"\n')
    counter = tmp_path / "compiles.txt"
    (root / "recipes" / "counted" / "recipe.yaml").write_text(COUNTED_RECIPE.format(counter=counter))
    (recipe,) = make_plan(root, ["counted"]).recipes
    report = build(root, ["counted"], tmp_path / "channel")
    built = sorted(p.name for r in report.results for p in r.packages)
    assert built == ["libcounted", "py-counted", "py-counted"]
    assert len(counter.read_text().splitlines()) == len(recipe.compiles) == 2
    assert sorted(c.name for c in recipe.compiles) == ["counted-compile (for libcounted)", "counted-compile (for py-counted)"]


def test_a_render_is_made_once_per_process_from_the_same_bytes_and_anew_when_a_byte_changes(tmp_path, monkeypatch):
    """render_recipe keeps what the engine rendered (0.25 s of CPU a call), keyed on the shared matrix, every
    file of the recipe's folder and the overrides; each caller gets a copy of its own."""
    import channelsmith.recipes as recipes

    shutil.copy(REPO / "conda_build_config.yaml", tmp_path / "conda_build_config.yaml")
    shutil.copytree(REPO / "recipes" / "site-env", tmp_path / "recipes" / "site-env")
    (recipe,) = select_recipes(tmp_path, ["site-env"])
    engine_calls = []
    real = recipes._render_recipe
    monkeypatch.setattr(recipes, "_render_recipe", lambda *args: engine_calls.append(args) or real(*args))
    first = render_recipe(tmp_path, recipe)
    first.outputs.clear()  # a caller's changes stay its own
    again = render_recipe(tmp_path, recipe)
    assert len(engine_calls) == 1 and again.outputs and {o.version for o in again.outputs} == {"1.0.0"}
    render_recipe(tmp_path, recipe, {"site": SITES[0]})  # other overrides: rendered
    assert len(engine_calls) == 2
    recipe_file = tmp_path / "recipes" / "site-env" / "recipe.yaml"
    recipe_file.write_text(recipe_file.read_text().replace('version: "1.0.0"', 'version: "1.0.1"'))
    assert {o.version for o in render_recipe(tmp_path, recipe).outputs} == {"1.0.1"} and len(engine_calls) == 3
    (tmp_path / "recipes" / "site-env" / "sites" / "new-file.sh").write_text("# any byte of the folder counts\n")
    render_recipe(tmp_path, recipe)
    assert len(engine_calls) == 4
