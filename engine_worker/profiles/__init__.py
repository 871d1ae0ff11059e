"""Timing profiles shipped with the worker, and reading / writing profile files.

A profile file is the msgspec JSON encoding of :class:`indexer.profile.TimingProfile`,
nothing more, so that a profile fitted on a live worker (``engine_worker.profile_fit``)
can be saved and shipped next to the packaged ones. Each packaged file says in its
``source`` field where every coefficient comes from.

Packaged profiles:

* ``llama3_8b_h100`` (the default): Llama-3-8B in bf16 on one H100 SXM under
  vLLM V1 defaults. Step overhead, per-token prefill cost and per-sequence
  decode cost come from the BLIS blackbox fit for Llama-3.1-8B-Instruct on an
  H100 (``inference-sim/inference-sim``, ``defaults.yaml``); the attention and
  KV-read terms from FLOP and byte counts at stated effective rates; the load
  bandwidths from PCIe Gen5 host-to-device and NVMe read figures;
  ``max_num_batched_tokens`` is vLLM's default for the API server on an H100.
* ``llama3_8b_a100``: the same model on one A100-SXM4-80GB, from the same fit's
  A100 coefficients and the same method (about 3x the H100's prefill time and
  2x its decode step); with it ``kvrouter bench sim --profile
  llama3_8b_h100,llama3_8b_a100`` replays a trace on a mixed fleet.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import msgspec

from indexer.profile import TimingProfile

__all__ = [
    "DEFAULT_PROFILE",
    "ProfileError",
    "default_profile",
    "load_fleet",
    "load_profile",
    "packaged_profiles",
    "save_profile",
]

DEFAULT_PROFILE = "llama3_8b_h100"
_SUFFIX = ".json"


class ProfileError(ValueError):
    """A profile file is missing, unreadable, or not a valid timing profile."""


def packaged_profiles() -> list[str]:
    """Names of the profiles shipped in this package, sorted."""
    root = resources.files(__name__)
    return sorted(
        entry.name.removesuffix(_SUFFIX) for entry in root.iterdir() if entry.name.endswith(_SUFFIX)
    )


def _decode(data: bytes, origin: str) -> TimingProfile:
    try:
        return msgspec.json.decode(data, type=TimingProfile)
    except msgspec.DecodeError as exc:
        raise ProfileError(f"{origin}: not a valid timing profile: {exc}") from exc


def default_profile() -> TimingProfile:
    """The default profile: Llama-3-8B bf16 on one H100 (see the module docstring).

    A fresh object on every call, so that callers cannot alter each other's copy.
    """
    return load_profile(DEFAULT_PROFILE)


def load_profile(path_or_name: str | os.PathLike[str]) -> TimingProfile:
    """Load a profile from a file path, or by the name of a packaged profile.

    A string without a path separator and without the ``.json`` suffix names a
    packaged profile (``"llama3_8b_h100"``); anything else is a file path.

    Raises:
        ProfileError: The file or name does not exist, or its content is not a
            valid profile (bad JSON, missing fields, negative coefficients).
    """
    text = os.fspath(path_or_name)
    if os.sep not in text and "/" not in text and not text.endswith(_SUFFIX):
        entry = resources.files(__name__).joinpath(text + _SUFFIX)
        if not entry.is_file():
            raise ProfileError(
                f"no packaged profile {text!r}; packaged: {', '.join(packaged_profiles())}"
            )
        return _decode(entry.read_bytes(), f"profile {text!r}")
    path = Path(text)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ProfileError(f"cannot read profile file {path}: {exc}") from exc
    return _decode(data, str(path))


def load_fleet(names: str | Sequence[str]) -> list[TimingProfile]:
    """The profiles of a fleet, from names or paths (or one comma-separated string).

    Raises:
        ProfileError: None given, one does not load, or they are of different models
            (their KV bytes per token differ: a fleet serves one model).
    """
    if isinstance(names, str):
        names = names.split(",")
    profiles = [load_profile(n.strip()) for n in names if n.strip()]
    if not profiles:
        raise ProfileError("no timing profile given")
    if len({p.kv_bytes_per_token for p in profiles}) > 1:
        sizes = ", ".join(f"{p.name} {p.kv_bytes_per_token}" for p in profiles)
        raise ProfileError(
            f"the profiles are of different models (KV bytes per token: {sizes}); "
            "a fleet serves one model"
        )
    return profiles


def save_profile(profile: TimingProfile, path: str | os.PathLike[str]) -> Path:
    """Write ``profile`` as indented JSON to ``path``, atomically; return the path.

    The file is written beside the target and renamed over it, so a reader never
    sees half a profile.
    """
    target = Path(path)
    data = msgspec.json.format(msgspec.json.encode(profile), indent=2) + b"\n"
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
