#!/usr/bin/env bash
# iproute2 (`ip`, `tc`) for a GPU machine that has none (the lent 2-GPU machines had neither on 2026-11-27), which
# tools/slow_link.py needs to build a shaped link. Run here, where apt works, in the repository root:
#     bash tools/fetch_iproute2.sh            # fills .iproute2/ (git-ignored: add /.iproute2/ to .git/info/exclude)
# then carry ".iproute2" in the device call; slow_link.py puts .iproute2/root/{sbin,bin} on PATH and its libraries on
# LD_LIBRARY_PATH only where the machine has no `ip`/`tc` of its own. The packages are Debian bookworm's (amd64),
# unpacked with dpkg -x into .iproute2/root, never into / (the libraries ldd lists for ip and tc, glibc aside).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.iproute2
rm -rf "$dest" && mkdir -p "$dest/debs" "$dest/root" /tmp/fsl_apt_amd64/partial
apt_opts=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64)
(cd "$dest/debs" && apt-get "${apt_opts[@]}" download iproute2 libbpf1 libelf1 libmnl0 libbsd0 libmd0 libcap2 \
  libxtables12 zlib1g 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
for deb in "$dest"/debs/*.deb; do dpkg -x "$deb" "$dest/root"; done
# Debian's sbin/ip is a link to /bin/ip: an absolute link points outside the tree once carried (where the machine has
# no /bin/ip, the carried `ip` is missing). Each becomes a relative link inside the tree, or goes.
find "$dest/root" -type l -lname '/*' | while read -r link; do
  target="$dest/root$(readlink "$link")"
  if [ -e "$target" ]; then ln -sfr "$target" "$link"; else rm "$link"; fi
done
[ -z "$(find "$dest/root" -type l -lname '/*')" ] && [ -x "$dest/root/bin/ip" ] && [ -x "$dest/root/sbin/tc" ]
LD_LIBRARY_PATH="$dest/root/lib/x86_64-linux-gnu:$dest/root/usr/lib/x86_64-linux-gnu" "$dest/root/sbin/ip" -V
du -sh "$dest"
