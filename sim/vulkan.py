"""Point SAPIEN at a Vulkan driver on machines without a GPU.

SAPIEN (ManiSkill's simulator) opens a Vulkan device even for state observations. On a
machine without a GPU driver, ``tools/setup_vulkan.sh`` (run by ``make setup``) unpacks
Mesa 25's lavapipe, a CPU Vulkan driver, into ``.vulkan/`` at the repo root (or
``$OMNI_RL_VULKAN_DIR``). :func:`ensure_vulkan` selects it. Call it before sapien or
mani_skill is imported, in every process that imports them: the Vulkan loader reads
``VK_ICD_FILENAMES`` when it starts, and the dynamic loader reads ``LD_LIBRARY_PATH`` only
at process start, so the newer libdrm that lavapipe needs is preloaded by path instead.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from pathlib import Path

from omni_rl.errors import OmniRLError

VULKAN_DIR_ENV = "OMNI_RL_VULKAN_DIR"
ICD_MANIFEST = "lvp_icd.json"
_REPO_VULKAN_DIR = Path(__file__).resolve().parent.parent / ".vulkan"
_SYSTEM_ICD_DIRS = (Path("/usr/share/vulkan/icd.d"), Path("/etc/vulkan/icd.d"), Path("/usr/local/share/vulkan/icd.d"))
# lavapipe 25 needs libdrm >= 2.4.121; Debian 12's own is 2.4.114. Order matters: the
# second links against the first.
_PRELOAD = ("libdrm.so.2", "libdrm_amdgpu.so.1")

_selected: Path | None = None


def vulkan_dir() -> Path:
    """Where ``tools/setup_vulkan.sh`` unpacks lavapipe: ``$OMNI_RL_VULKAN_DIR``, else
    ``.vulkan/`` at the repo root (an installed wheel has no repo: set the variable)."""
    return Path(os.environ.get(VULKAN_DIR_ENV) or _REPO_VULKAN_DIR)


def gpu_vulkan_driver() -> bool:
    """Whether this machine has a GPU Vulkan driver: an NVIDIA ICD or device node, or a
    DRM render node beside a system ICD other than lavapipe (Debian installs the Intel and
    Radeon ICDs on machines without those GPUs, so an ICD file alone proves nothing).
    Mirrors ``has_gpu_vulkan`` in ``tools/setup_vulkan.sh``."""
    icds = [p for d in _SYSTEM_ICD_DIRS if d.is_dir() for p in d.glob("*.json")]
    if any(p.name == "nvidia_icd.json" for p in icds) or Path("/dev/nvidiactl").exists():
        return True
    render_nodes = list(Path("/dev/dri").glob("renderD*")) if Path("/dev/dri").is_dir() else []
    return bool(render_nodes) and any(not p.name.startswith("lvp_icd") for p in icds)


def ensure_vulkan() -> Path | None:
    """Select the project-local lavapipe for this process, where it is needed.

    A no-op where the user chose a driver (``VK_ICD_FILENAMES`` or ``VK_DRIVER_FILES``
    set), where a GPU driver is present, or where no unpacked lavapipe exists (SAPIEN then
    fails with its own error, which ``omni_rl.sim.maniskill`` explains). Safe to call
    more than once.

    Returns:
        The ICD manifest now selected, or None where the system's drivers stay in charge.
    """
    global _selected
    if _selected is None:
        _selected = _select_lavapipe()
    if _selected is not None:
        # SAPIEN looks for a system libvulkan first and warns when it falls back to its
        # own loader: expected here, where the system has none
        warnings.filterwarnings("ignore", message="Failed to find system libvulkan")
    return _selected


def _select_lavapipe() -> Path | None:
    """Preload lavapipe's libdrm and point the Vulkan loader at its ICD manifest, unless
    the system's drivers should stay in charge (see :func:`ensure_vulkan`)."""
    root = vulkan_dir()
    manifest = root / ICD_MANIFEST
    # A worker process inherits VK_ICD_FILENAMES from its parent but not the preloads.
    chosen = os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES")
    if (chosen and chosen != str(manifest)) or gpu_vulkan_driver():
        return None
    if not (root / ".complete").exists() or not manifest.exists():
        return None
    lib_dir = next((p.parent for p in root.glob("usr/lib/*/libvulkan_lvp.so")), None)
    if lib_dir is None:
        raise OmniRLError(f"{root}: no libvulkan_lvp.so inside; remove the folder and run tools/setup_vulkan.sh")
    for name in _PRELOAD:
        ctypes.CDLL(str(lib_dir / name), mode=ctypes.RTLD_GLOBAL)
    os.environ["VK_ICD_FILENAMES"] = str(manifest)
    return manifest
