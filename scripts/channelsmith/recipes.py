"""Load and render the repository's v1 recipes with py-rattler-build.

Nothing here renders Jinja or expands variants itself: py-rattler-build does both. This module finds
recipes, merges the shared variant matrix (``conda_build_config.yaml``) with a recipe's own
``variants.yaml``, narrows it by ``--variant KEY=VALUE`` overrides, and turns rendered outputs into
small dataclasses the rest of channelsmith reads.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rattler_build import RenderConfig, Stage0Recipe, VariantConfig

from channelsmith.errors import RecipeError, VariantError

CONFIG_FILE = "conda_build_config.yaml"
RECIPES_DIR = "recipes"
RECIPE_FILE = "recipe.yaml"
RECIPE_VARIANTS_FILE = "variants.yaml"

# Variant keys a staging output (the shared libtorch compile) must not depend on: every Python
# version reuses one compile, so two outputs that differ only in these share their heavy build.
PER_PYTHON_KEYS = frozenset({"python", "numpy", "python_abi"})

# Keys rattler-build adds to every variant; they never distinguish one build from another here.
ENGINE_KEYS = frozenset({"target_platform", "build_platform", "host_platform"})


@dataclass(frozen=True)
class Recipe:
    """One recipe directory under ``recipes/``."""

    name: str
    path: Path

    @property
    def recipe_file(self) -> Path:
        return self.path / RECIPE_FILE

    @property
    def variants_file(self) -> Path | None:
        candidate = self.path / RECIPE_VARIANTS_FILE
        return candidate if candidate.is_file() else None


@dataclass(frozen=True)
class Source:
    """One rendered source entry: where upstream code comes from and which patches apply to it."""

    url: str | None
    sha256: str | None
    git: str | None
    rev: str | None
    path: str | None
    patches: tuple[Path, ...]
    # Globs of the only files taken from the source (rattler-build's `filter:`); empty: all of them.
    filter: tuple[str, ...] = ()


@dataclass(frozen=True)
class StagingBuild:
    """A staging output (a heavy compile, e.g. libtorch) and the identity that decides reuse."""

    name: str
    key: str


@dataclass(frozen=True)
class RenderedOutput:
    """One package a recipe produces for one variant combination."""

    recipe: str
    name: str
    version: str
    build_string: str
    noarch: str | None
    variant: dict[str, str]
    sources: tuple[Source, ...]
    staging: tuple[StagingBuild, ...]
    requirements: dict[str, tuple[str, ...]]
    # about.license (SPDX) and about.license_file (paths the engine copies from the source or
    # recipe folder).
    license: str = ""
    license_files: tuple[str, ...] = ()
    # build.variant.down_prioritize_variant: rattler-build gives the package this many track_features,
    # and a solver takes a build without them first (a site's own builds, recipes/site-env).
    down_priority: int = 0

    @property
    def patches(self) -> tuple[Path, ...]:
        return tuple(p for s in self.sources for p in s.patches)

    @property
    def identity(self) -> tuple[str, str, str]:
        return (self.name, self.version, self.build_string)

    @property
    def needs_channels(self) -> bool:
        """Whether building it needs packages from a channel (conda-forge); False = builds offline."""
        return any(self.requirements.get(kind) for kind in ("build", "host"))

    @property
    def remote_sources(self) -> bool:
        """Whether its sources must be downloaded (url or git) rather than read from this repository."""
        return any(s.url or s.git for s in self.sources)


@dataclass
class RecipeRender:
    """Everything one recipe renders to across the (possibly narrowed) variant matrix."""

    recipe: Recipe
    combinations: list[dict[str, str]]
    outputs: list[RenderedOutput] = field(default_factory=list)


def find_root(start: Path | None = None) -> Path:
    """The repository root: the nearest folder upwards holding conda_build_config.yaml and recipes/."""
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / CONFIG_FILE).is_file() and (candidate / RECIPES_DIR).is_dir():
            return candidate
    raise RecipeError(
        f"no channelsmith repository found at or above {here}",
        hint=f"run inside the repository (the folder with {CONFIG_FILE} and {RECIPES_DIR}/) or pass --root",
    )


def list_recipes(root: Path) -> list[Recipe]:
    """Every recipe in the repository, sorted by name."""
    base = root / RECIPES_DIR
    return [
        Recipe(name=p.name, path=p)
        for p in sorted(base.iterdir())
        if p.is_dir() and (p / RECIPE_FILE).is_file()
    ]


def select_recipes(root: Path, names: Iterable[str]) -> list[Recipe]:
    """The named recipes (all of them when no name is given); unknown names are a RecipeError."""
    available = {r.name: r for r in list_recipes(root)}
    wanted = list(names)
    if not wanted:
        return list(available.values())
    unknown = [n for n in wanted if n not in available]
    if unknown:
        raise RecipeError(
            f"unknown recipe {', '.join(repr(n) for n in unknown)}",
            hint=f"known recipes: {', '.join(sorted(available)) or '(none)'}",
        )
    return [available[n] for n in wanted]


def _check_yaml(path: Path) -> None:
    """Parse a YAML file only to report syntax errors with file and line (rendering stays the engine's)."""
    try:
        yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise RecipeError(
            f"YAML syntax error in {where}: {exc.problem or exc}",
            hint="fix the indentation or syntax at that line",
        ) from None
    except OSError as exc:
        raise RecipeError(f"cannot read {path}: {exc.strerror}") from None


def _load_variants(path: Path) -> VariantConfig:
    """One variant file read by the engine; on failure, PyYAML says where the syntax breaks."""
    try:
        return VariantConfig.from_file(str(path))
    except Exception as exc:
        _check_yaml(path)
        raise RecipeError(f"variant file {path} cannot be read: {_engine_message(exc)}") from None


def variant_config(root: Path, recipe: Recipe) -> VariantConfig:
    """The shared matrix merged with the recipe's own variants.yaml (the recipe's keys win)."""
    config = _load_variants(root / CONFIG_FILE)
    if recipe.variants_file is not None:
        config = config.merge(_load_variants(recipe.variants_file))
    return config


def parse_overrides(pairs: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings from the command line as a dict; malformed ones are a VariantError."""
    overrides: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise VariantError(
                f"malformed --variant {pair!r}",
                hint="write it as KEY=VALUE, e.g. --variant site=derecho",
            )
        overrides[key.strip()] = value.strip()
    return overrides


def combinations(config: VariantConfig, overrides: Mapping[str, str], recipe: Recipe) -> list[dict[str, str]]:
    """The variant combinations of ``config`` that match every override.

    An override naming a key the matrix does not have, or a value no combination has, is a
    VariantError that lists what exists.
    """
    combos = [{k: str(v) for k, v in c.items()} for c in config.combinations()]
    known = set(config.to_dict()) - {"zip_keys"}
    for key, value in overrides.items():
        if key not in known:
            raise VariantError(
                f"unknown variant key {key!r} for recipe {recipe.name}",
                hint=f"known keys: {', '.join(sorted(known))}",
            )
        values = sorted({c[key] for c in combos if key in c})
        if value not in values:
            raise VariantError(
                f"variant {key}={value} is not in the matrix of recipe {recipe.name}",
                hint=f"values of {key}: {', '.join(values)} (edit {CONFIG_FILE} or the recipe's "
                f"{RECIPE_VARIANTS_FILE} to add one)",
            )
    return [c for c in combos if all(c.get(k) == v for k, v in overrides.items())]


def single_config(combo: Mapping[str, str]) -> VariantConfig:
    """A variant config holding exactly one combination (one engine call per combination)."""
    return VariantConfig({k: [v] for k, v in combo.items()})


def load_stage0(recipe: Recipe) -> Stage0Recipe:
    """The recipe parsed by py-rattler-build; syntax errors name the file and line."""
    try:
        return Stage0Recipe.from_file(str(recipe.recipe_file))
    except Exception as exc:  # PyYAML locates plain syntax errors; the engine's text covers the rest
        _check_yaml(recipe.recipe_file)
        raise RecipeError(
            f"recipe {recipe.recipe_file} does not parse: {exc}",
            hint="compare with docs/reference/recipes.md and the v1 recipe format (CEP-13/14)",
        ) from None


def render_variants(recipe: Recipe, stage0: Stage0Recipe, config: VariantConfig) -> list[Any]:
    """py-rattler-build's rendered variants; render failures become RecipeErrors."""
    try:
        return stage0.render(variant_config=config, render_config=RenderConfig())
    except Exception as exc:
        raise RecipeError(
            f"recipe {recipe.name} does not render: {_engine_message(exc)}",
            hint=f"check {recipe.recipe_file} and its variant keys ({CONFIG_FILE}, {RECIPE_VARIANTS_FILE})",
        ) from None


def _engine_message(exc: BaseException) -> str:
    text = str(exc)
    match = re.search(r'message: "([^"]+)"', text)
    return match.group(1) if match else text


def _sources(recipe: Recipe, raw: Iterable[Mapping[str, Any]]) -> tuple[Source, ...]:
    sources = []
    for entry in raw:
        patches = tuple((recipe.path / p).resolve() for p in entry.get("patches", []) or [])
        sources.append(
            Source(
                url=_first(entry.get("url")),
                sha256=entry.get("sha256"),
                git=entry.get("git"),
                rev=entry.get("rev") or entry.get("tag") or entry.get("branch"),
                path=entry.get("path"),
                patches=patches,
                filter=tuple(str(f) for f in _as_list(entry.get("filter"))),
            )
        )
    return tuple(sources)


def _first(value: Any) -> str | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def to_output(recipe: Recipe, rendered: Any, siblings: frozenset[str] = frozenset()) -> RenderedOutput:
    """A rendered variant as a RenderedOutput (sources come from its staging output when it inherits one).

    ``siblings`` are the names of the recipe's other outputs: a pin on one of them is not a variant
    of the staging build, so it is left out of the staging identity.
    """
    data = rendered.recipe.to_dict()
    variant = {k: str(v) for k, v in rendered.variant.items() if k not in ENGINE_KEYS}
    raw_sources = list(data.get("source", []) or [])
    staging = []
    for cache in data.get("staging_caches", []) or []:
        raw_sources.extend(cache.get("source", []) or [])
        shared = {k: v for k, v in variant.items() if k not in siblings}
        staging.append(StagingBuild(name=cache["name"], key=_staging_key(recipe, cache, shared)))
    build = data.get("build", {}) or {}
    requirements: dict[str, list[str]] = {}
    for section in (data.get("requirements") or {}, *(c.get("requirements") or {} for c in data.get("staging_caches") or [])):
        for kind, specs in section.items():
            if isinstance(specs, list):
                requirements.setdefault(kind, []).extend(str(s) for s in specs)
    return RenderedOutput(
        recipe=recipe.name,
        name=data["package"]["name"],
        version=str(data["package"]["version"]),
        build_string=str(build.get("string", "")),
        noarch=build.get("noarch"),
        variant=variant,
        sources=_sources(recipe, _dedupe(raw_sources)),
        staging=tuple(staging),
        requirements={k: tuple(v) for k, v in requirements.items()},
        license=str((data.get("about") or {}).get("license") or ""),
        license_files=tuple(str(f) for f in _as_list((data.get("about") or {}).get("license_file"))),
        down_priority=int((build.get("variant") or {}).get("down_prioritize_variant") or 0),
    )


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _dedupe(entries: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    seen: list[Mapping[str, Any]] = []
    for entry in entries:
        if entry not in seen:
            seen.append(entry)
    return seen


def _staging_key(recipe: Recipe, cache: Mapping[str, Any], variant: Mapping[str, str]) -> str:
    """What makes two staging builds the same compile: their content and every non-Python variant value."""
    shared = {k: v for k, v in sorted(variant.items()) if k not in PER_PYTHON_KEYS}
    body = {k: cache.get(k) for k in ("build", "requirements", "source")}
    return repr((recipe.name, cache.get("name"), body, shared))


# Renders this process made, by what they were made from (RENDER_CACHE_SIZE at most, the oldest dropped):
# one command (plan, build, lint) and the tests ask for the same recipe over the same matrix many times,
# and each engine call costs about 0.25 s of CPU.
RENDER_CACHE_SIZE = 64
_renders: dict[tuple[str, ...], RecipeRender] = {}


def _render_inputs(root: Path, recipe: Recipe, overrides: Mapping[str, str] | None) -> tuple[str, ...]:
    """What a render is made from: the shared matrix's bytes, every file of the recipe's folder, the overrides."""
    digest = hashlib.sha256((root / CONFIG_FILE).read_bytes())
    for path in sorted(p for p in recipe.path.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(recipe.path)).encode() + b"\0" + path.read_bytes() + b"\0")
    return (str(root.resolve()), str(recipe.path.resolve()), recipe.name, repr(sorted((overrides or {}).items())),
            digest.hexdigest())  # fmt: skip


def render_recipe(root: Path, recipe: Recipe, overrides: Mapping[str, str] | None = None) -> RecipeRender:
    """Render one recipe over its (narrowed) matrix; outputs are de-duplicated by name/version/build string.

    A render made before in this process from the same bytes is returned again (a copy of its own)."""
    try:
        key = _render_inputs(root, recipe, overrides)
    except OSError:
        key = None  # a file that cannot be read: the engine says what is wrong with it
    if key is not None and key in _renders:
        return copy.deepcopy(_renders[key])
    result = _render_recipe(root, recipe, overrides)
    if key is not None:
        _renders[key] = copy.deepcopy(result)
        while len(_renders) > RENDER_CACHE_SIZE:
            del _renders[next(iter(_renders))]
    return result


def _render_recipe(root: Path, recipe: Recipe, overrides: Mapping[str, str] | None) -> RecipeRender:
    config = variant_config(root, recipe)
    combos = combinations(config, overrides or {}, recipe)
    stage0 = load_stage0(recipe)
    narrowed = config if not overrides else _narrow(combos, config)
    result = RecipeRender(recipe=recipe, combinations=combos)
    seen: set[tuple[str, str, str]] = set()
    variants = render_variants(recipe, stage0, narrowed)
    siblings = frozenset(v.recipe.package.name for v in variants)
    for rendered in variants:
        output = to_output(recipe, rendered, siblings)
        if output.identity not in seen:
            seen.add(output.identity)
            result.outputs.append(output)
    return result


def _narrow(combos: list[dict[str, str]], config: VariantConfig) -> VariantConfig:
    """A variant config holding only ``combos`` (zipped so that no new combination appears)."""
    keys = sorted({k for c in combos for k in c})
    variants = {k: [c.get(k, "") for c in combos] for k in keys}
    return VariantConfig(variants, zip_keys=[keys] if len(keys) > 1 else None)


def used_combinations(root: Path, recipe: Recipe, overrides: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """The distinct combinations of the keys the recipe actually uses (one engine call builds each)."""
    rendered = render_recipe(root, recipe, overrides)
    used_keys = sorted({k for o in rendered.outputs for k in o.variant})
    distinct: list[dict[str, str]] = []
    for combo in rendered.combinations:
        narrowed = {k: combo[k] for k in used_keys if k in combo}
        if narrowed not in distinct:
            distinct.append(narrowed)
    return distinct
