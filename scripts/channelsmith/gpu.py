"""Which GPUs a solve is for: this machine's, a site profile's compute nodes', or the ones named.

A package with GPU code requires the `cuda-arch` metapackage, whose version X constrains the
`__cuda_arch` virtual package to X (conda-incubator/nvidia-virtual-packages README, "The cuda-arch
metapackage"). py-rattler reports `__cuda_arch` (the lowest compute capability of the machine's
GPUs) and `__cuda` (the driver's CUDA) where a GPU answers, and neither on a login or build node.
There a constraint on an absent virtual package holds, so without this module an sm_90-only build
would install for an A100 partition with no error.

Each site profile (`site-env-<site>`, recipes/site-env) declares its compute nodes' `__cuda_arch`
and driver `__cuda` as run constraints on those virtual packages. Where no GPU answers, a solve
naming a profile is made for those values; where a GPU answers and disagrees with the profile,
the deploy stops (exit 2) naming both; with neither, a solve that brings in `cuda-arch` is refused
with the way to name the GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from rattler import (
    BuildString,
    Gateway,
    GenericVirtualPackage,
    MatchSpec,
    PackageName,
    RepoDataRecord,
    Subdir,
    Version,
    VirtualPackage,
    VirtualPackageOverrides,
)

from channelsmith.channel import run_rattler
from channelsmith.errors import DeployError

CUDA_ARCH = "__cuda_arch"
CUDA = "__cuda"
# The metapackage every package with GPU code requires (recipes/cuda-arch builds this channel's own).
CUDA_ARCH_PACKAGE = "cuda-arch"
# A site profile: recipes/site-env builds one per site, and every site build requires its site's.
SITE_PROFILE_PREFIX = "site-env-"
OVERRIDE_ARCH = "CONDA_OVERRIDE_CUDA_ARCH"
OVERRIDE_CUDA = "CONDA_OVERRIDE_CUDA"
NO_GPU_HINT = (
    "name the GPUs the environment is for: a site profile that declares them (site-env-<site>), "
    f"--cuda-arch 8.0 (the lowest compute capability of the nodes' GPUs), or {OVERRIDE_ARCH}=8.0 "
    f"together with {OVERRIDE_CUDA}=12.x (the driver's CUDA; without it no __cuda_arch is reported)"
)


@dataclass(frozen=True)
class SiteGpus:
    """What a site profile declares about its compute nodes (None where it declares nothing)."""

    profile: str
    cuda_arch: str | None
    cuda: str | None


@dataclass(frozen=True)
class GpuTarget:
    """The GPUs a solve was made for, and where that came from.

    ``source`` is one of: ``detected`` (a GPU answered here), ``override`` (CONDA_OVERRIDE_CUDA_ARCH),
    ``option`` (--cuda-arch), ``profile`` (the site profile's compute nodes), ``none``.
    """

    cuda_arch: str | None
    cuda: str | None
    source: str
    profile: str | None
    detected_cuda_arch: str | None
    summary: str


def _version_of(packages: Sequence[GenericVirtualPackage], name: str) -> str | None:
    return next((str(p.version) for p in packages if p.name.normalized == name), None)


def detected_virtual_packages() -> list[GenericVirtualPackage]:
    """This machine's virtual packages, CONDA_OVERRIDE_* honoured, as generic ones."""
    # from_env() honours CONDA_OVERRIDE_CUDA / _CUDA_ARCH / _GLIBC / ...; detect() alone ignores them.
    try:
        return [p.into_generic() for p in VirtualPackage.detect(VirtualPackageOverrides.from_env())]
    except Exception as exc:  # rattler raises DetectVirtualPackageError or VirtualPackageOverrideError
        raise DeployError(
            f"cannot detect the system's virtual packages: {exc}",
            hint="check CONDA_OVERRIDE_* variables (e.g. CONDA_OVERRIDE_CUDA=12.9, or empty for no CUDA)",
        ) from None


def site_gpus(record: RepoDataRecord) -> SiteGpus:
    """The compute nodes' `__cuda_arch` and `__cuda` a site profile's record declares.

    recipes/site-env writes them as ``__cuda_arch ==X`` and ``__cuda >=Y`` run constraints.
    """
    arch = cuda = None
    for text in record.constrains:
        spec = MatchSpec(text)
        name = spec.name.normalized if spec.name is not None else ""
        version = str(spec.version or "")
        if name == CUDA_ARCH and version.startswith("=="):
            arch = version[2:]
        elif name == CUDA and version.startswith(">="):
            cuda = version[2:]
    return SiteGpus(record.name.normalized, arch, cuda)


def named_profile(specs: Sequence[str]) -> str | None:
    """The site profile a spec names (site-env-<site>), if any."""
    for spec in specs:
        try:
            name = MatchSpec(spec).name
        except Exception:  # InvalidMatchSpecError: the solve reports it, with the way to write specs
            continue
        if name is not None and name.normalized.startswith(SITE_PROFILE_PREFIX):
            return name.normalized
    return None


def find_profile(profile: str, channel_urls: Sequence[str]) -> SiteGpus | None:
    """The declarations of the newest build of ``profile`` in the first channel holding it."""
    platforms = [Subdir.current(), Subdir("noarch")]
    for url in channel_urls:
        found = run_rattler(Gateway().query([url], platforms, [MatchSpec(profile)], recursive=False))
        records = [r for per_platform in found for r in per_platform]
        if records:
            newest = max(records, key=lambda r: (r.version, r.build_number))
            return site_gpus(newest)
    return None


def _arch_value(text: str) -> str:
    major, dot, minor = text.partition(".")
    if not (major.isdigit() and dot and minor.isdigit()):
        raise DeployError(
            f"--cuda-arch {text!r} is not a compute capability",
            hint="write MAJOR.MINOR, e.g. --cuda-arch 8.0 for A100, 9.0 for H100",
        )
    return text


def gpu_target(
    detected: Sequence[GenericVirtualPackage], profile: SiteGpus | None, cuda_arch: str | None = None
) -> GpuTarget:
    """Decide the `__cuda_arch` and `__cuda` a solve is for.

    ``cuda_arch`` (--cuda-arch) first, else a GPU that answers (or CONDA_OVERRIDE_CUDA_ARCH standing
    for one), else the profile's compute nodes. The first two win over the profile but must agree with it: DeployError (exit 2) naming both when its compute capability differs from
    the profile's, or its driver's CUDA is older than the profile declares.
    """
    seen_arch = _version_of(detected, CUDA_ARCH)
    seen_cuda = _version_of(detected, CUDA)
    if os.environ.get(OVERRIDE_ARCH) and seen_arch is None:
        # py-rattler 0.28 reports __cuda_arch only where it reports __cuda, as the specification says
        # (conda-incubator/nvidia-virtual-packages nvidia_virtual_packages/cuda/arch.py at 13e7a698).
        raise DeployError(
            f"{OVERRIDE_ARCH}={os.environ[OVERRIDE_ARCH]} is set, but no {CUDA_ARCH} is reported without {CUDA}",
            hint=f"set {OVERRIDE_CUDA}=12.x (the compute nodes' driver CUDA) as well, or pass --cuda-arch instead",
        )
    name = profile.profile if profile else None
    if cuda_arch is not None:
        arch, source = _arch_value(cuda_arch), "option"
    elif seen_arch is not None:
        arch, source = seen_arch, "override" if os.environ.get(OVERRIDE_ARCH) else "detected"
    elif profile is not None and profile.cuda_arch is not None:
        arch, source = profile.cuda_arch, "profile"
    else:
        arch, source = None, "none"
    cuda = seen_cuda if seen_cuda is not None else (profile.cuda if profile else None)
    where = {
        "option": f"--cuda-arch {arch}",
        "override": f"{OVERRIDE_ARCH}={arch}",
        "detected": f"this machine's GPUs (lowest compute capability {arch})",
    }
    named_by = {"option": "--cuda-arch", "override": OVERRIDE_ARCH}
    if profile is not None and profile.cuda_arch is not None and source != "profile" and arch != profile.cuda_arch:
        raise DeployError(
            f"{where[source]} disagrees with the site profile {name}, whose compute nodes report "
            f"{CUDA_ARCH} {profile.cuda_arch}: the environment would be solved for GPUs it will not run on",
            hint=f"deploy on a {name} compute node or a node without GPUs, or name the profile of the site "
            f"whose GPUs these are" + (f", or drop {named_by[source]}" if source in named_by else ""),
        )
    older_driver = seen_cuda is not None and profile is not None and profile.cuda is not None
    if older_driver and Version(seen_cuda) < Version(profile.cuda):
        raise DeployError(
            f"this machine's driver supports CUDA {seen_cuda} ({CUDA}), older than the {profile.cuda} the site "
            f"profile {name} declares for its compute nodes",
            hint=f"deploy on a {name} compute node or a node without GPUs, or unset {OVERRIDE_CUDA}",
        )
    if source == "profile":
        summary = (
            f"no GPU answers here: solved for the compute nodes of {name} "
            f"({CUDA_ARCH} {arch}, {CUDA} {cuda or 'none'})"
        )
    elif source == "none":
        summary = f"no GPU answers here and no GPUs are named: solved without {CUDA_ARCH}" + (
            f" ({CUDA} {cuda})" if cuda else ""
        )
    else:
        summary = f"solved for {where[source]} ({CUDA_ARCH} {arch}, {CUDA} {cuda or 'none'})" + (
            f", which agrees with {name}" if profile is not None and profile.cuda_arch is not None else ""
        )
    return GpuTarget(arch, cuda, source, name, seen_arch, summary)


def solve_virtual_packages(detected: Sequence[GenericVirtualPackage], target: GpuTarget) -> list[GenericVirtualPackage]:
    """This machine's virtual packages with `__cuda_arch` and `__cuda` as ``target`` says."""
    kept = [p for p in detected if p.name.normalized not in (CUDA_ARCH, CUDA)]
    for name, value in ((CUDA, target.cuda), (CUDA_ARCH, target.cuda_arch)):
        if value is not None:
            kept.append(GenericVirtualPackage(PackageName(name), Version(value), BuildString("0")))
    return kept


def check_gpu_code_has_a_target(records: Sequence[RepoDataRecord], target: GpuTarget) -> None:
    """DeployError when a solve made without `__cuda_arch` brings in a package with GPU code.

    Its `cuda-arch` constraint held only because no `__cuda_arch` was there to contradict it: the
    package would install for GPUs it may have no code for.
    """
    if target.cuda_arch is not None:
        return
    gpu = sorted(
        r.name.normalized
        for r in records
        if any(MatchSpec(d).name is not None and MatchSpec(d).name.normalized == CUDA_ARCH_PACKAGE for d in r.depends)
    )
    if gpu or any(r.name.normalized == CUDA_ARCH_PACKAGE for r in records):
        raise DeployError(
            f"no GPU answers here and no GPUs are named, but {', '.join(gpu) or CUDA_ARCH_PACKAGE} "
            "has GPU code: it would install without checking that the nodes' GPUs can run it",
            hint=NO_GPU_HINT,
        )


def lock_target(records: Sequence[RepoDataRecord]) -> tuple[str | None, str | None]:
    """The `__cuda_arch` an environment was solved for (its cuda-arch version) and its site profile."""
    arch = next((str(r.version) for r in records if r.name.normalized == CUDA_ARCH_PACKAGE), None)
    profile = next((r.name.normalized for r in records if r.name.normalized.startswith(SITE_PROFILE_PREFIX)), None)
    return arch, profile


def solved_for(arch: str | None, profile: str | None) -> str:
    """One line saying which GPUs an environment's packages were solved for."""
    if arch is None:
        return "no package with GPU code (no cuda-arch)"
    return f"solved for {CUDA_ARCH} {arch}" + (f" ({profile})" if profile else "")


def gpu_disagreement(arch: str | None, what: str) -> str | None:
    """Why ``what``, solved for `__cuda_arch` ``arch``, must not be used here; None where it may.

    Only a GPU that answers (or CONDA_OVERRIDE_CUDA_ARCH) can disagree: on a node without one, the
    environment is for other nodes, which is what a login node installs.
    """
    seen = _version_of(detected_virtual_packages(), CUDA_ARCH)
    if arch is None or seen is None or seen == arch:
        return None
    return (
        f"this machine's GPUs report {CUDA_ARCH} {seen}, but {what} was solved for {CUDA_ARCH} {arch} "
        "(its cuda-arch package): its GPU code may not run here"
    )
