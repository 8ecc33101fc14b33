#!/usr/bin/env bash
# Vagrant boxes for the kernel lines, built offline from Debian packages, so
# that nobody depends on a box registry: `vagrant/build-box.sh [SUITE...]`
# (default: bookworm trixie) writes .vm-cache/boxes/nodesampler-debian12.box
# and -debian13.box (provider libvirt) and adds them with `vagrant box add`
# when vagrant is installed.
#
# A box is a whole disk: an MBR with one ext4 partition made by `mkfs.ext4 -d`
# at a 1 MiB offset (no loop devices, no mounts) and GRUB written into the
# MBR gap from grub-mkimage's core image, so it boots like any disk, under
# libvirt's kvm or qemu driver alike. Inside: Debian's kernel (its headers
# packages kept aside, not installed), systemd, sshd, the vagrant user with Vagrant's insecure
# key (replaced at the first `vagrant up`), DHCP on eth0, and whatever
# vagrant/provision.sh installs, run through chroot; so the box comes up and
# provisions without network.
#
# NODESAMPLER_BOX_DIR (default .vm-cache/boxes), NODESAMPLER_DEBIAN_MIRROR,
# NODESAMPLER_VAGRANT_PUBKEY (default: the one the installed vagrant ships).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${NODESAMPLER_BOX_DIR:-.vm-cache/boxes}
mirror=${NODESAMPLER_DEBIAN_MIRROR:-http://deb.debian.org/debian}
suites=${*:-bookworm trixie}
disk_mib=8192
mkdir -p "$out"

missing=""
for tool in debootstrap:debootstrap qemu-img:qemu-utils grub-mkimage:grub-pc-bin sfdisk:fdisk mkfs.ext4:e2fsprogs; do
    command -v "${tool%%:*}" >/dev/null || missing="$missing ${tool##*:}"
done
if [ -n "$missing" ]; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
fi
pubkey=${NODESAMPLER_VAGRANT_PUBKEY:-$(ls /usr/share/rubygems-integration/all/gems/vagrant-*/keys/vagrant.pub \
    /opt/vagrant/embedded/gems/gems/vagrant-*/keys/vagrant.pub 2>/dev/null | head -n 1 || true)}
[ -r "$pubkey" ] || { echo "build-box: no Vagrant public key: install vagrant or set NODESAMPLER_VAGRANT_PUBKEY" >&2; exit 1; }

box_name() { case $1 in bookworm) echo debian12 ;; trixie) echo debian13 ;; *) echo "$1" ;; esac; }

build() {
    local suite=$1 name work root kver t0=$SECONDS
    name=nodesampler-$(box_name "$suite")
    work="$out/$name.work"
    root="$work/root"
    rm -rf "$work" && mkdir -p "$work"
    debootstrap --variant=minbase \
        --include="$(sh vagrant/provision.sh --packages),systemd-sysv,udev,openssh-server,sudo,ifupdown,dhcpcd-base,iproute2,rsync" \
        "$suite" "$root" "$mirror" >"$work/build.log" 2>&1 || { tail -20 "$work/build.log" >&2; return 1; }
    cp vagrant/provision.sh "$root/provision.sh"
    chroot "$root" sh /provision.sh --kernel-from "$suite" --no-project >>"$work/build.log" 2>&1 \
        || { tail -20 "$work/build.log" >&2; return 1; }
    kver=$(ls "$root/lib/modules")
    rm "$root/provision.sh"

    echo "$name" >"$root/etc/hostname"
    echo "LABEL=root / ext4 defaults 0 1" >"$root/etc/fstab"
    printf 'auto lo\niface lo inet loopback\n\nallow-hotplug eth0\niface eth0 inet dhcp\n' >"$root/etc/network/interfaces"
    chroot "$root" useradd --create-home --shell /bin/bash vagrant
    echo vagrant:vagrant | chroot "$root" chpasswd
    echo "vagrant ALL=(ALL) NOPASSWD: ALL" >"$root/etc/sudoers.d/vagrant"
    chmod 0440 "$root/etc/sudoers.d/vagrant"
    install -d -m 0700 -o 1000 -g 1000 "$root/home/vagrant/.ssh"
    install -m 0600 -o 1000 -g 1000 "$pubkey" "$root/home/vagrant/.ssh/authorized_keys"
    # Every box from one build would share the host keys made by openssh's
    # postinst: each guest makes its own at first boot instead.
    rm -f "$root"/etc/ssh/ssh_host_*
    mkdir -p "$root/etc/systemd/system/ssh.service.d"
    # (ExecStartPre is reset: the unit's own `sshd -t` would fail before them.)
    printf '[Service]\nExecStartPre=\nExecStartPre=/usr/bin/ssh-keygen -A\nExecStartPre=/usr/sbin/sshd -t\n' \
        >"$root/etc/systemd/system/ssh.service.d/host-keys.conf"

    # GRUB from the host's grub-pc-bin: its modules in /boot/grub, a config
    # that boots this kernel (net.ifnames=0: the first NIC is eth0 under every
    # provider), the core image in the gap before the partition.
    mkdir -p "$root/boot/grub"
    cp -r /usr/lib/grub/i386-pc "$root/boot/grub/"
    cat >"$root/boot/grub/grub.cfg" <<CFG
serial --unit=0 --speed=115200
terminal_input serial console
terminal_output serial console
set timeout=1
menuentry "Debian $suite, $kver" {
    linux /boot/vmlinuz-$kver root=LABEL=root ro console=tty0 console=ttyS0,115200 net.ifnames=0
    initrd /boot/initrd.img-$kver
}
CFG
    local disk="$work/disk.raw"
    truncate -s "${disk_mib}M" "$disk"
    printf 'label: dos\nstart=2048, type=83, bootable\n' | sfdisk -q "$disk"
    mkfs.ext4 -q -F -L root -E offset=1048576 -d "$root" "$disk" "$((disk_mib - 1))M"
    grub-mkimage -O i386-pc -o "$work/core.img" -p "(hd0,msdos1)/boot/grub" \
        biosdisk part_msdos ext2 normal linux serial terminal configfile
    # boot.img's code only (440 bytes: the partition table after it stays),
    # then the core image from sector 1, where boot.img looks for it.
    dd if=/usr/lib/grub/i386-pc/boot.img of="$disk" bs=440 count=1 conv=notrunc status=none
    dd if="$work/core.img" of="$disk" bs=512 seek=1 conv=notrunc status=none
    rm -rf "$root"

    qemu-img convert -O qcow2 "$disk" "$work/box.img"
    printf '{"provider": "libvirt", "format": "qcow2", "virtual_size": %d}\n' "$((disk_mib / 1024))" >"$work/metadata.json"
    tar -C "$work" -cf "$out/$name.box" metadata.json box.img
    rm -rf "$work"
    echo "box $name ($kver) built in $((SECONDS - t0)) s: $out/$name.box"
    if command -v vagrant >/dev/null; then
        vagrant box add --force --name "nodesampler/$(box_name "$suite")" "$out/$name.box"
    fi
}

for suite in $suites; do
    build "$suite"
done
