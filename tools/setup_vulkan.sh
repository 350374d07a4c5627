#!/usr/bin/env bash
# Give SAPIEN (ManiSkill's simulator) a Vulkan device on a machine without a GPU driver.
#
# SAPIEN needs a Vulkan device even for state observations. Debian 12's own lavapipe
# (Mesa 22) lacks descriptorBindingPartiallyBound and is rejected; Mesa 25's lavapipe from
# bookworm-backports works. This script downloads that driver and the libdrm it needs,
# unpacks them with `dpkg-deb -x` into a project-local folder (default .vulkan/, or
# $OMNI_RL_VULKAN_DIR) and writes an ICD manifest there. Nothing is installed into the
# system. omni_rl.sim.vulkan.ensure_vulkan() selects the driver at run time.
#
# Idempotent: a complete folder is left as it is; a machine with a GPU Vulkan driver is
# left alone. Usage: tools/setup_vulkan.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${OMNI_RL_VULKAN_DIR:-$ROOT/.vulkan}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm-backports
# package=version this project was tested with; the index decides what is downloaded.
PACKAGES=(
    mesa-vulkan-drivers=25.0.7-2~bpo12+1
    libdrm2=2.4.123-1~bpo12+1
    libdrm-amdgpu1=2.4.123-1~bpo12+1
    libdrm-common=2.4.123-1~bpo12+1
)
SYSTEM_ICD_DIRS=(/usr/share/vulkan/icd.d /etc/vulkan/icd.d /usr/local/share/vulkan/icd.d)

say() { echo "setup_vulkan: $*" >&2; }
die() { say "error: $*"; exit 1; }

# A GPU driver is there: an NVIDIA ICD, device node or working nvidia-smi, or a DRM render node
# together with a system ICD other than lavapipe (Debian installs the Intel and Radeon
# ICDs on machines without those GPUs, so an ICD file alone proves nothing). Mirrored by
# omni_rl.sim.vulkan.gpu_vulkan_driver.
has_gpu_vulkan() {
    local dir icd
    for dir in "${SYSTEM_ICD_DIRS[@]}"; do
        [[ -e $dir/nvidia_icd.json ]] && return 0
    done
    [[ -e /dev/nvidiactl ]] && return 0
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && return 0
    compgen -G "/dev/dri/renderD*" >/dev/null || return 1
    for dir in "${SYSTEM_ICD_DIRS[@]}"; do
        for icd in "$dir"/*.json; do
            [[ -e $icd && $(basename "$icd") != lvp_icd* ]] && return 0
        done
    done
    return 1
}

# Print "filename sha256 version" of a package from the suite's index on stdin.
index_entry() {
    awk -v pkg="$1" '
        /^Package: / { inside = ($2 == pkg) }
        inside && /^Version: / { version = $2 }
        inside && /^Filename: / { file = $2 }
        inside && /^SHA256: / { sha = $2 }
        /^$/ && inside && file { print file, sha, version; exit }
        END { if (inside && file) print file, sha, version }'
}

if [[ -f $DEST/.complete ]]; then
    exit 0
fi
if has_gpu_vulkan; then
    say "a GPU Vulkan driver is present; nothing to do"
    exit 0
fi
for tool in curl xz dpkg-deb sha256sum; do
    command -v "$tool" >/dev/null || die "'$tool' is needed to unpack the Vulkan driver"
done
ARCH=$(dpkg --print-architecture)

mkdir -p "$(dirname "$DEST")"
WORK=$(mktemp -d "$DEST.tmp.XXXXXX")  # beside DEST, so the final mv is a rename
trap 'rm -rf "$WORK"' EXIT
say "fetching the $SUITE index"
curl -fsSL --retry 3 "$MIRROR/dists/$SUITE/main/binary-$ARCH/Packages.xz" | xz -dc >"$WORK/Packages"

for spec in "${PACKAGES[@]}"; do
    name=${spec%%=*}
    tested=${spec#*=}
    read -r file sha version < <(index_entry "$name" <"$WORK/Packages") || true
    [[ -n ${file:-} ]] || die "$name is not in $SUITE ($MIRROR)"
    [[ $version == "$tested" ]] || say "warning: $name $version (tested with $tested)"
    say "downloading $name $version"
    curl -fsSL --retry 3 -o "$WORK/pkg.deb" "$MIRROR/$file"
    echo "$sha  $WORK/pkg.deb" | sha256sum -c --quiet - || die "$name: checksum mismatch"
    dpkg-deb -x "$WORK/pkg.deb" "$WORK/root"
    echo "$name $version" >>"$WORK/root/.complete.tmp"
    rm "$WORK/pkg.deb"
done

LVP=$(find "$WORK/root" -name libvulkan_lvp.so -print -quit)
[[ -n $LVP ]] || die "libvulkan_lvp.so is missing from mesa-vulkan-drivers"
missing=$(LD_LIBRARY_PATH=$(dirname "$LVP") ldd "$LVP" | awk '/not found/ { print $1 }')
[[ -z $missing ]] || die "libvulkan_lvp.so needs system libraries that are missing: $(echo $missing)"

# The manifest names the driver relative to itself, so the folder can move with the repo.
API=$(sed -n 's/.*"api_version": *"\([^"]*\)".*/\1/p' "$WORK"/root/usr/share/vulkan/icd.d/lvp_icd*.json)
cat >"$WORK/root/lvp_icd.json" <<JSON
{
    "file_format_version": "1.0.0",
    "ICD": {
        "library_path": ".${LVP#"$WORK/root"}",
        "api_version": "${API:-1.3.0}"
    }
}
JSON
mv "$WORK/root/.complete.tmp" "$WORK/root/.complete"
rm -rf "$DEST"
mv "$WORK/root" "$DEST"
say "lavapipe unpacked into $DEST"
