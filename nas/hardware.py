"""Which device the search designs for, and the latency profile that describes it.

    --profile FILE          that profile (its hardware must match --hardware when both are given)
    --hardware NAME         a stored profile <dir>/<NAME>-<target>.json when one exists; otherwise one is
                            made with hwprofile: measured when NAME is this machine, else predicted
                            (roofline from configs/hardware/NAME.yaml, calibrated on this machine)
    neither                 NAME = this machine's canonical name (hwprofile.device.local_device)

A stored measured profile of this machine's hardware name is used only when it was measured on the same
kind of machine (CPU model, cores and vector extensions; GPU product): "cpu" covers CPUs whose few-row
kernels differ by 2x (decode.runtime.small_rows), so another machine's profile is skipped (the next stored one,
<hardware>-<target>@<tag>.json, is tried: stored_candidates) and, when none fits, this one measured;
so is one whose draft tables were measured for a smaller search space than the search's (e.g. the stored CPU profile,
made for the demo and cpu scales' `compact` space, for a search of the `default` space with its cross-attention
fusions and 3-4 layer drafts): a draft cost outside the tables would be extrapolated.

Every choice is logged; a profile of another target (fingerprints differ) is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from decode.drafts.pack import cpu_format
from decode.errors import UserError
from decode.runtime.compiled import compile_tag
from decode.runtime.small_rows import linear_kernels
from decode.space import SearchSpace, default_space_name
from decode.targets.compat import fingerprint_diff
from decode.targets.loader import pick_device
from decode.targets.target import TargetModel
from hwprofile.device import DeviceInfo, local_device, other_machine
from hwprofile.latency import LatencyModel
from hwprofile.schema import Profile, default_profile_path
from hwprofile.specs import known_hardware

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileChoice:
    hardware: str
    path: Path
    how: str  # given | stored | measured | predicted
    latency: LatencyModel

    def describe(self) -> dict:
        """Identity of the profile (what a study's values depend on; not how it was found this time)."""
        p = self.latency.profile
        return {"hardware": self.hardware, "path": str(self.path.resolve()), "predicted": p.predicted,
                "date": p.date, "runtime": p.runtime, "dtype": p.dtype}


def local_hardware(device: str = "auto") -> str:
    return local_device(pick_device(device)).hardware


def check_hardware(name: str, local: str) -> None:
    known = known_hardware()
    if name != local and name not in known:
        raise UserError(f"unknown hardware '{name}'; use one of: {', '.join(sorted(set(known) | {local}))}")


def stale_kernels(profile: Profile, target: TargetModel) -> str | None:
    """Why a measured profile's step and verify costs are not this target's now: it was measured with another
    attention implementation (profiles before decode.targets.attention record none: transformers' SDPA, whose
    repeat_kv made every multi-token verify dearer), or, on a CPU, with other few-row linear kernels (profiles
    before decode.runtime.small_rows' cold-weight choice record none: one-row steps ran MKL's one-core GEMV, and
    some 2-3 row verifies the slower product), or, for the compiled runtime, with other compile settings (profiles
    before single-threaded CPU inductor kernels record none). None when all match or the profile is predicted.
    Recorded but not checked: the eager KV cache ("kv_cache") and the attention kernel's version ("attention_kernel"):
    the in-place cache and the second attention kernel moved a step and a 2-8 token verify of the default target by
    2-11% in one process and not measurably on the bench (benchmarks/MEASUREMENTS.md, thirteenth session), within a
    measured profile's own hour-to-hour noise on the VM that measured them."""
    if profile.predicted:
        return None
    cpu = profile.device.get("kind") == "cpu"
    # the native attention kernel ("+native") is a CPU kernel: a GPU profile read on a CPU host compares the rest
    attention = target.attention_kernels() if cpu else target.model.config._attn_implementation
    checks = [("attention", attention, "tree attention", "verify costs differ")]
    if cpu:
        checks.append(("linear", linear_kernels(), "few-row linear kernels", "step and verify costs differ"))
        checks.append(("draft_weights", cpu_format(), "draft weights", "draft level costs differ"))
    if profile.runtime == "compiled":
        checks.append(("compiled", compile_tag(profile.device.get("kind") or "cpu"), "compiled graphs",
                       "step and verify costs differ"))
    for key, have, what, why in checks:
        theirs = profile.versions.get(key)
        if theirs != have:
            return f"measured with {'older' if theirs is None else repr(theirs)} {what}, not {have!r} ({why})"
    return None


def check_profile(profile: Profile, path: Path, target: TargetModel, hardware: str | None) -> None:
    # strict, config hash included: a profile times one software stack, not only one target (decode/targets/compat.py)
    diff, _ = fingerprint_diff(profile.target.get("fingerprint", {}), target.fingerprint().to_dict())
    if diff:
        raise UserError(f"profile {path} is for target '{profile.target_name}', not '{target.name}' ({diff}); "
                        "profile this target with python -m hwprofile.profile")
    if hardware is not None and profile.hardware != hardware:
        raise UserError(f"profile {path} describes hardware '{profile.hardware}', not '{hardware}'; drop --hardware "
                        "or pass a profile of that device")


def resolve_profile(target: TargetModel, hardware: str | None, profile: str | None, search_dirs: list[Path],
                    write_dir: Path, device: str = "auto", space: str | None = None, quick: bool = False,
                    cache_dir: str | None = None, runtime: str = "eager",
                    search_space: SearchSpace | None = None) -> ProfileChoice:
    """The profile to search with (see the module doc); makes one through hwprofile when none is stored.
    runtime: the decoding runtime the design is for; its profile (<hardware>-<target>[-compiled].json).
    search_space: the space searched, which a stored profile must cover (None: the space `space` names)."""
    local = local_hardware(device)
    if profile is not None:
        path = Path(profile)
        prof = Profile.load(path)
        check_profile(prof, path, target, hardware)
        if prof.runtime != runtime:
            raise UserError(f"profile {path} measured the {prof.runtime} runtime, not {runtime}; pass --runtime "
                            f"{prof.runtime} or a profile of the {runtime} runtime")
        logger.info("hardware %s: profile %s (given, %s)", prof.hardware, path,
                    "predicted" if prof.predicted else "measured")
        return ProfileChoice(prof.hardware, path, "given", LatencyModel(prof))
    hardware = hardware or local
    check_hardware(hardware, local)
    for path in stored_candidates(hardware, target.name, search_dirs, runtime):
        if path.is_file():
            prof = Profile.load(path)
            check_profile(prof, path, target, hardware)
            stale = stale_kernels(prof, target)
            if hardware == local and not prof.predicted:
                differs = other_machine(DeviceInfo.from_dict(prof.device), local_device(pick_device(device)))
                if differs:  # e.g. a "cpu" profile from another CPU: its verify/step ratios are not this one's
                    logger.warning("hardware %s: the stored profile %s was measured on another machine (%s); "
                                   "not using it", hardware, path, differs)  # then measured (below)
                    continue
                if stale:  # this machine can measure it again, with the kernels decoding now runs
                    logger.warning("hardware %s: the stored profile %s was %s; not using it", hardware, path, stale)
                    continue
                searched = search_space or SearchSpace.load(space or default_space_name(target.name))
                short = uncovered(prof.space or {}, searched)
                if short:  # measured for a smaller space: this one's draft costs would be extrapolated
                    logger.warning("hardware %s: the stored profile %s does not cover the search space (%s); not "
                                   "using it", hardware, path, short)
                    continue
            elif stale:  # another device's profile: it stays, with a warning
                logger.warning("hardware %s: the stored profile %s was %s: its predictions overprice trees; "
                               "re-measure it there with python -m hwprofile.profile", hardware, path, stale)
            logger.info("hardware %s: using the stored %s profile %s", hardware,
                           "predicted" if prof.predicted else "measured", path)
            return ProfileChoice(hardware, path, "stored", LatencyModel(prof))
    from hwprofile.config import ProfileConfig
    from hwprofile.profile import run as run_profile

    path = default_profile_path(hardware, target.name, write_dir, runtime)
    predict = hardware != local
    if predict and runtime != "eager":
        raise UserError(f"no measured {runtime}-runtime profile of {target.name} on {hardware} (looked for {path.name}), "
                        f"and predictions model the eager runtime only; measure it there with python -m "
                        f"hwprofile.profile --runtime {runtime}")
    logger.warning("hardware %s: no stored profile of %s usable here; %s one -> %s", hardware, target.name,
                   f"predicting (roofline, calibrated on this {local})" if predict else "measuring", path)
    cfg = ProfileConfig(hardware=hardware, target=target.name, device=device, space=space, out=str(path),
                        predict=predict, quick=quick, cache_dir=cache_dir, runtime=runtime)
    prof, path = run_profile(cfg)
    check_profile(prof, path, target, hardware)
    return ProfileChoice(hardware, path, "predicted" if predict else "measured", LatencyModel(prof))


def stored_candidates(hardware: str, target: str, search_dirs: list[Path], runtime: str = "eager") -> list[Path]:
    """Stored profiles a search may use, in order: per folder <hardware>-<target>[-runtime].json, then the same name
    with a machine tag, <hardware>-<target>[-runtime]@<tag>.json (e.g. cpu-smolvlm-135m@avx2.json): "cpu" names
    CPUs whose verify costs differ 2x, so profiles/ keeps one per kind of CPU a search has run on, and each
    search takes the first one measured on its own kind of machine."""
    out: list[Path] = []
    for d in dict.fromkeys(search_dirs):  # ordered, without repeats
        path = default_profile_path(hardware, target, d, runtime)
        out += [path, *sorted(d.glob(f"{path.stem}@*.json"))]
    return out


RANGED = ("depth", "heads", "ffn", "top_k", "total_tokens")  # numeric choices a profile prices within its range


def outside_range(covered: dict, space) -> dict[str, tuple[list, list]]:
    """{field: (the profile's measured choices, the space's choices outside their range)} for the RANGED fields of
    a profile's recorded space `covered` (Profile.space) that `space` (a SearchSpace) exceeds."""
    out = {}
    for name in RANGED:
        have = [v for v in covered.get(name, []) if v is not None]
        outside = [v for v in getattr(space, name) if have and not min(have) <= v <= max(have)]
        if outside:
            out[name] = (have, outside)
    return out


def uncovered(covered: dict, space) -> str | None:
    """Why a profile's draft tables, measured for the space `covered` (Profile.space), do not price every choice of
    `space` (a SearchSpace): fusions or draft vocabularies it never measured, or choices outside its ranges. None
    when it covers them all (or records no space: profiles made before it was recorded)."""
    if not covered:
        return None
    why = []
    for name in ("fusion", "draft_vocab"):
        missing = set(getattr(space, name)) - set(covered.get(name, []))
        if missing:
            why.append(f"{name} {sorted(missing, key=str)} not measured")
    why += [f"{name} {outside} outside {min(have)}..{max(have)}"
            for name, (have, outside) in outside_range(covered, space).items()]
    return "; ".join(why) or None


def warn_extrapolation(latency: LatencyModel, space) -> list[str]:
    """Search-space choices outside the range the profile's draft tables were measured over (their
    latency is extrapolated linearly); each is logged as a warning. -> the affected field names."""
    out = outside_range(latency.profile.space or {}, space)
    for name, (have, outside) in out.items():
        logger.warning("profile covers %s %s..%s; choices %s are extrapolated", name, min(have), max(have), outside)
    return list(out)
