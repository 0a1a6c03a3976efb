"""Which GPUs a solve is for: this machine's, a site profile's compute nodes', or the ones named.

A package with GPU code requires the `cuda-arch` metapackage, whose version X constrains the
`__cuda_arch` virtual package to X (conda-incubator/nvidia-virtual-packages README, "The cuda-arch
metapackage"), and `__cuda`. py-rattler reports `__cuda_arch` (the lowest compute capability of the
machine's GPUs) and `__cuda` (the driver's CUDA) where a GPU answers, and neither on a login or
build node. There a constraint on an absent `__cuda_arch` holds, so without this module an
sm_90-only build would install for an A100 partition with no error; and a requirement of `__cuda`
has no candidate, so nothing with GPU code installs at all.

Each site profile (`site-env-<site>`, recipes/site-env) declares its compute nodes' `__cuda_arch`
and driver `__cuda` as run constraints on those virtual packages; --cuda-arch and --cuda-driver
name them where no profile does (the driver defaults to DEFAULT_CUDA_DRIVER). Where no GPU
answers, a solve is made for what is named; where a GPU answers and disagrees with it, the deploy
stops (exit 2) naming both, unless --ignore-gpus-here sets this machine's GPUs aside (and the
output says so); with nothing named, a solve that brings in `cuda-arch` is refused with the way to
name the GPUs. An environment is checked where it is used (a lock, a bundle, verify) against the
`cuda-arch` range each of its packages requires: the GPU code it carries, not the one capability
it was solved for, so that one environment may serve two GPU generations.
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
    VersionSpec,
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
# The `__cuda` a solve for named GPUs gets where nothing names the nodes' driver: the oldest CUDA 12
# driver. A CUDA 12.x build runs on any CUDA 12 driver (CUDA minor version compatibility; conda-forge's
# cuda-version 12.x constrains `__cuda >=12` only, cuda-version-feedstock recipe/meta.yaml at d548d47),
# and no CUDA 13 build is taken for nodes whose driver nobody named.
DEFAULT_CUDA_DRIVER = "12.0"
# Sets aside a GPU that answers here and disagrees with what was named (the deploy says so).
IGNORE_GPUS_HERE = "--ignore-gpus-here"
NO_GPU_HINT = (
    "name the GPUs the environment is for: a site profile that declares them (site-env-<site>), "
    "--cuda-arch 8.0 (the lowest compute capability of the nodes' GPUs) with --cuda-driver 12.4 (their "
    f"driver's CUDA, default {DEFAULT_CUDA_DRIVER}), or {OVERRIDE_ARCH}=8.0 together with {OVERRIDE_CUDA}=12.x "
    "(without it no __cuda_arch is reported)"
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

    ``source`` (of ``cuda_arch``) is one of: ``detected`` (a GPU answered here), ``override``
    (CONDA_OVERRIDE_CUDA_ARCH), ``option`` (--cuda-arch), ``profile`` (the site profile's compute
    nodes), ``none``. ``cuda_source`` (of ``cuda``): ``option`` (--cuda-driver), ``detected``,
    ``override`` (CONDA_OVERRIDE_CUDA), ``profile``, ``default`` (DEFAULT_CUDA_DRIVER), ``none``.
    ``ignored_gpus_here``: a GPU answered here, disagreed with what was named, and --ignore-gpus-here
    set it aside (``detected_cuda_arch`` and ``detected_cuda`` say what it reported).
    """

    cuda_arch: str | None
    cuda: str | None
    source: str
    profile: str | None
    detected_cuda_arch: str | None
    summary: str
    cuda_source: str = "none"
    detected_cuda: str | None = None
    ignored_gpus_here: bool = False


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


def _major_minor(text: str, option: str, hint: str) -> str:
    """``text`` as MAJOR.MINOR without leading zeros (8.00 -> 8.0), as a client reports it; else DeployError."""
    major, dot, minor = text.strip().partition(".")
    if not (major.isdigit() and dot and minor.isdigit()):
        raise DeployError(f"{option} {text!r} is not MAJOR.MINOR", hint=hint)
    return f"{int(major)}.{int(minor)}"


def _same(a: str, b: str) -> bool:
    """Whether two versions are one (8.0 and 8.00 are the same compute capability)."""
    return Version(a) == Version(b)


def gpu_target(
    detected: Sequence[GenericVirtualPackage],
    profile: SiteGpus | None,
    cuda_arch: str | None = None,
    cuda_driver: str | None = None,
    ignore_gpus_here: bool = False,
) -> GpuTarget:
    """Decide the `__cuda_arch` and `__cuda` a solve is for.

    What is named for the nodes (``cuda_arch``/``cuda_driver``, i.e. --cuda-arch/--cuda-driver, else the
    profile's declarations) must agree with the profile: DeployError (exit 2) where --cuda-arch is another
    compute capability or --cuda-driver is older. A GPU that answers here (or CONDA_OVERRIDE_CUDA_ARCH
    standing for one) must agree with what is named too, unless ``ignore_gpus_here`` (--ignore-gpus-here)
    sets it aside, which the summary says. `__cuda_arch`: --cuda-arch, else this machine's, else the
    profile's. `__cuda`: --cuda-driver, else this machine's, else the profile's, else
    DEFAULT_CUDA_DRIVER where a `__cuda_arch` is solved for (a package with GPU code requires `__cuda`).
    Versions are compared as versions.
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
    option_arch = None if cuda_arch is None else _major_minor(
        cuda_arch, "--cuda-arch", "write MAJOR.MINOR, e.g. --cuda-arch 8.0 for A100, 9.0 for H100")
    option_cuda = None if cuda_driver is None else _major_minor(
        cuda_driver, "--cuda-driver",
        'write MAJOR.MINOR, the "CUDA Version" nvidia-smi prints on a compute node, e.g. --cuda-driver 12.4')
    profile_arch = profile.cuda_arch if profile else None
    profile_cuda = profile.cuda if profile else None
    if option_arch is not None and profile_arch is not None and not _same(option_arch, profile_arch):
        raise DeployError(
            f"--cuda-arch {option_arch} disagrees with the site profile {name}, whose compute nodes report "
            f"{CUDA_ARCH} {profile_arch}: the environment would be solved for GPUs it will not run on",
            hint="drop --cuda-arch, or name the profile of the site whose GPUs these are",
        )
    if option_cuda is not None and profile_cuda is not None and Version(option_cuda) < Version(profile_cuda):
        raise DeployError(
            f"--cuda-driver {option_cuda} is older than the {profile_cuda} the site profile {name} declares for "
            f"its compute nodes ({CUDA} >={profile_cuda})",
            hint="drop --cuda-driver, or name the profile of the site whose driver this is",
        )
    # What the nodes are said to have, and by whom.
    named_arch = option_arch if option_arch is not None else profile_arch
    named_cuda = option_cuda if option_cuda is not None else profile_cuda
    by_arch = (f"--cuda-arch {option_arch}" if option_arch is not None
               else f"the site profile {name}, whose compute nodes report {CUDA_ARCH} {profile_arch}")
    by_cuda = f"--cuda-driver {option_cuda}" if option_cuda is not None else f"the site profile {name}"
    overridden = bool(os.environ.get(OVERRIDE_ARCH))
    here = (f"{OVERRIDE_ARCH}={seen_arch}" if overridden
            else f"this machine's GPUs (lowest compute capability {seen_arch})")
    disagreements = []
    if seen_arch is not None and named_arch is not None and not _same(seen_arch, named_arch):
        disagreements.append(f"{here} disagrees with {by_arch}: the environment would be solved for GPUs it "
                             "will not run on")
    if seen_cuda is not None and named_cuda is not None and Version(seen_cuda) < Version(named_cuda):
        disagreements.append(f"this machine's driver supports CUDA {seen_cuda} ({CUDA}), older than the "
                             f"{named_cuda} {by_cuda} declares for the compute nodes")
    if disagreements and not ignore_gpus_here:
        unset = f", or unset {OVERRIDE_ARCH} and {OVERRIDE_CUDA}" if overridden or os.environ.get(OVERRIDE_CUDA) else ""
        named_what = "the profile's" if option_arch is None and option_cuda is None else "the named"
        raise DeployError(
            "; ".join(disagreements),
            hint=(f"deploy on a node without GPUs or on one of the nodes named, or name the profile of the site "
                  f"whose GPUs these are{unset}, or pass {IGNORE_GPUS_HERE} to solve for {named_what} GPUs "
                  "anyway (the environment may not run on this machine)"),
        )
    ignored = bool(disagreements)
    if option_arch is not None:
        arch, source = option_arch, "option"
    elif seen_arch is not None and not ignored:
        arch, source = seen_arch, "override" if overridden else "detected"
    elif profile_arch is not None:
        arch, source = profile_arch, "profile"
    else:
        arch, source = None, "none"
    if option_cuda is not None:
        cuda, cuda_source = option_cuda, "option"
    elif seen_cuda is not None and not ignored:
        cuda, cuda_source = seen_cuda, "override" if os.environ.get(OVERRIDE_CUDA) else "detected"
    elif profile_cuda is not None:
        cuda, cuda_source = profile_cuda, "profile"
    elif arch is not None:
        # Every package with GPU code requires __cuda: without one, nothing with GPU code installs.
        cuda, cuda_source = DEFAULT_CUDA_DRIVER, "default"
    else:
        cuda, cuda_source = None, "none"
    summary = _summary(arch, source, cuda, cuda_source, name, profile_arch is not None, ignored)
    if ignored:
        summary += (f"; this machine's GPUs ({CUDA_ARCH} {seen_arch or 'none'}, {CUDA} {seen_cuda or 'none'}) "
                    f"disagree and were set aside ({IGNORE_GPUS_HERE}): the environment may not run here")
    return GpuTarget(arch, cuda, source, name, seen_arch, summary, cuda_source, seen_cuda, ignored)


def _summary(arch: str | None, source: str, cuda: str | None, cuda_source: str, name: str | None,
             profile_declares: bool, ignored: bool) -> str:
    """The `GPUs:` line: which `__cuda_arch` and `__cuda` the solve was for, and where each came from."""
    if cuda_source == "default":
        driver = (f"{CUDA} {cuda}, the default: no GPU, profile or --cuda-driver names the nodes' driver, "
                  "pass --cuda-driver X.Y")
    else:
        driver = f"{CUDA} {cuda or 'none'}" + (" from --cuda-driver" if cuda_source == "option" else "")
    if source == "none":
        return f"no GPU answers here and no GPUs are named: solved without {CUDA_ARCH}" + (
            f" ({CUDA} {cuda})" if cuda else "")
    if source == "profile":
        return ("" if ignored else "no GPU answers here: ") + (
            f"solved for the compute nodes of {name} ({CUDA_ARCH} {arch}, {driver})")
    where = {
        "option": f"--cuda-arch {arch}",
        "override": f"{OVERRIDE_ARCH}={arch}",
        "detected": f"this machine's GPUs (lowest compute capability {arch})",
    }[source]
    return f"solved for {where} ({CUDA_ARCH} {arch}, {driver})" + (
        f", which agrees with {name}" if profile_declares else "")


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


def gpu_code_ranges(records: Sequence[RepoDataRecord]) -> dict[str, str]:
    """Package -> the `cuda-arch` versions it requires: the GPUs its code runs on (">=8.0", ">=8.0,<9.0a0")."""
    ranges = {}
    for record in records:
        for text in record.depends:
            try:
                spec = MatchSpec(text)
            except Exception:  # InvalidMatchSpecError: not a cuda-arch requirement either way
                continue
            if spec.name is not None and spec.name.normalized == CUDA_ARCH_PACKAGE:
                ranges[record.name.normalized] = str(spec.version or "*")
    return ranges


def runs_on(records: Sequence[RepoDataRecord]) -> str | None:
    """The `__cuda_arch` every package's GPU code runs on, as one version spec (None: no GPU code)."""
    ranges = sorted(set(gpu_code_ranges(records).values()))
    return ",".join(ranges) if ranges else None


def solved_for(arch: str | None, profile: str | None, runs: str | None = None) -> str:
    """One line saying which GPUs an environment's packages were solved for, and which they run on."""
    if arch is None:
        return "no package with GPU code (no cuda-arch)"
    return f"solved for {CUDA_ARCH} {arch}" + (f" ({profile})" if profile else "") + (
        f"; its GPU code runs where {CUDA_ARCH} is {runs}" if runs else "")


def gpu_disagreement(records: Sequence[RepoDataRecord], what: str) -> str | None:
    """Why ``what`` (an environment's ``records``) must not be used here; None where it may.

    Only a GPU that answers (or CONDA_OVERRIDE_CUDA_ARCH) can disagree: on a node without one, the
    environment is for other nodes, which is what a login node installs. It disagrees where some
    package's `cuda-arch` range leaves its `__cuda_arch` out, not where the environment was merely
    solved for another capability: generic's builds (`cuda-arch >=8.0`, sm_80 + sm_90 + PTX) solved
    for an A100 partition run on the H100 partition too.
    """
    seen = _version_of(detected_virtual_packages(), CUDA_ARCH)
    if seen is None:
        return None
    without_code = sorted(
        f"{name} (cuda-arch {spec})"
        for name, spec in gpu_code_ranges(records).items()
        if not VersionSpec(spec).matches(Version(seen))
    )
    if not without_code:
        return None
    arch, _ = lock_target(records)
    solved = f"was solved for {CUDA_ARCH} {arch}" if arch else f"was solved without {CUDA_ARCH}"
    return (
        f"this machine's GPUs report {CUDA_ARCH} {seen}, but {what} {solved} and holds GPU code that does not "
        f"run on them: {', '.join(without_code)}"
    )
