"""The container image, built and run without a container runtime.

There is no Docker daemon here, and `podman run` cannot start containers (crun is refused
setrlimit), so: a Debian base made by mmdebstrap from Debian's packages and loaded with
`podman import`, the repository's Dockerfile built on it by `podman build --isolation=chroot`,
and the image's root filesystem run as Kubernetes runs it for Envoy Gateway: mounted
read-only, a tmpfs at /tmp, the config bind-mounted read-only, uid 65534, the image's
environment. The process runs under strace, so that every write it tries outside its tmpfs
is seen, even one whose failure it swallows.

Podman keeps its images, layers and state on a tmpfs of the test's, unmounted afterwards,
not in /var/lib/containers. The mmdebstrap tarball is cached in .tools/image/
(`rm -r .tools/image` makes it anew).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .helpers import DOCKERFILE, ROOT

SUITE = "bookworm"
PACKAGES = "python3,python3-venv,python-is-python3,ca-certificates"
MMDEBSTRAP = ["mmdebstrap", "--variant=minbase", f"--include={PACKAGES}", "--format=tar", SUITE]
BASE_CACHE = ROOT / ".tools" / "image"
BASE_IMAGE = f"localhost/fairlimit-base:{SUITE}"
IMAGE = "localhost/fairlimit:test"
# pip inside the build needs the host's certificate bundle (its own does not carry the
# authorities this machine's HTTPS traffic is signed by).
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD = ["build", "--isolation=chroot", "--format", "docker"]  # docker: keeps HEALTHCHECK
EG_UID = 65534  # the uid Envoy Gateway runs its rate-limit container as (the gid here too)

# The calls that can write to a file system: by path (%file, every call that takes one), by
# fd, and bind (a unix socket is a file). On a read-only mount a write fails with EROFS.
TRACED = "%file,bind,fchmod,fchown,fsetxattr,fremovexattr,ftruncate,fallocate"


def base_tarball(mmdebstrap: str, tmpdir: Path) -> Path:
    """The Debian base as a tarball, made once per set of mmdebstrap arguments (in tmpdir)."""
    key = hashlib.sha256(" ".join(MMDEBSTRAP).encode()).hexdigest()[:12]
    tarball = BASE_CACHE / f"debian-{SUITE}-{key}.tar"
    if not tarball.exists():
        BASE_CACHE.mkdir(parents=True, exist_ok=True)
        partial = tarball.with_suffix(".part")
        partial.unlink(missing_ok=True)  # what an interrupted run left
        tmpdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TMPDIR": str(tmpdir)}
        run([mmdebstrap, *MMDEBSTRAP[1:], str(partial)], timeout=900, env=env)
        partial.rename(tarball)
    return tarball


def run(command: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """command's stdout; an AssertionError with its output when it fails."""
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result.stdout


class Podman:
    """podman with its storage, run state and temporary files in ``workdir``."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.workdir = workdir
        for name in ("storage", "run", "libpod", "tmp"):
            (workdir / name).mkdir(parents=True, exist_ok=True)
        self.command = [
            binary, "--root", str(workdir / "storage"), "--runroot", str(workdir / "run"),
            "--tmpdir", str(workdir / "libpod"), "--storage-driver", "overlay",
            "--events-backend", "none", "--cgroup-manager", "cgroupfs",
        ]  # fmt: skip
        self.env = {**os.environ, "TMPDIR": str(workdir / "tmp")}

    def __call__(self, *args: str, timeout: float = 120) -> str:
        return run([*self.command, *args], timeout, self.env)

    def load_base(self, tarball: Path) -> None:
        """The mmdebstrap tarball as the image BASE_IMAGE (`podman import`)."""
        self("import", str(tarball), BASE_IMAGE, timeout=300)

    def build(self) -> None:
        """The repository's Dockerfile on the Debian base, as the Dockerfile's header says."""
        volumes = ["-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro"] if CA_BUNDLE.exists() else []
        self(
            *BUILD, *volumes, "--build-arg", f"PYTHON_IMAGE={BASE_IMAGE}", "-t", IMAGE,
            "-f", str(DOCKERFILE), str(ROOT), timeout=900,
        )  # fmt: skip

    def inspect(self, image: str) -> dict[str, Any]:
        """`podman image inspect`: Config (User, Env, Entrypoint, Cmd...), Healthcheck..."""
        (inspected,) = json.loads(self("image", "inspect", image))
        found: dict[str, Any] = inspected
        return found


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below ``path`` in this mount namespace, deepest first."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = Path(line.split()[4].replace("\\040", " "))
        if point == path or path in point.parents:
            points.append(point)
    return sorted(points, key=lambda p: len(p.parts), reverse=True)


def unmount(point: Path) -> None:
    """umount, detaching lazily if something still holds it (never left mounted)."""
    if subprocess.run(["umount", str(point)], capture_output=True, check=False).returncode:
        subprocess.run(["umount", "--lazy", str(point)], capture_output=True, check=False)


@contextlib.contextmanager
def scratch_tmpfs(prefix: str, size: str) -> Iterator[Path]:
    """A new directory with a tmpfs on it, unmounted and removed on leaving.

    Podman's storage is kept in one: its ~20,000 files took ~30 s to delete from this
    machine's disk, and nothing on a tmpfs needs deleting.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=700", "tmpfs", str(path)], 30)
        run(["mount", "--make-private", str(path)], 30)
        yield path
    finally:
        remove_tree(path)


def remove_tree(path: Path) -> None:
    """Unmount whatever is mounted at or below ``path`` (podman's own binds too), remove it."""
    for point in mounts_under(path):
        unmount(point)
    left = mounts_under(path)
    assert not left, f"still mounted, {path} not removed: {left}"
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def read_only_tree(source: Path, target: Path, binds: dict[str, Path]) -> Iterator[Path]:
    """``source`` at ``target``, read-only, with a tmpfs at /tmp, /proc, and ``binds``.

    ``binds`` maps a directory that exists in ``source`` (say /srv) to a host directory,
    mounted there read-only. Everything is unmounted on leaving, whatever happened inside.
    """
    with contextlib.ExitStack() as stack:
        target.mkdir()
        stack.callback(unmount, target)
        run(["mount", "--bind", str(source), str(target)], 30)
        # Private: where / is a shared mount (systemd's default), a bind of it would pass the
        # mounts made below on to its peers, the tmpfs at /tmp to the machine's own /tmp.
        run(["mount", "--make-private", str(target)], 30)
        run(["mount", "-o", "remount,bind,ro", str(target)], 30)
        for inside, options, kind in (
            ("tmp", "size=64m,mode=1777,nosuid,nodev", "tmpfs"),
            ("proc", "nosuid,nodev,noexec", "proc"),
        ):
            stack.callback(unmount, target / inside)
            run(["mount", "-t", kind, "-o", options, kind, str(target / inside)], 30)
        for inside, host in binds.items():
            point = target / inside.lstrip("/")
            assert point.is_dir(), f"{inside}: no such directory in {source} to mount on"
            stack.callback(unmount, point)
            run(["mount", "--bind", str(host), str(point)], 30)
            run(["mount", "-o", "remount,bind,ro", str(point)], 30)
        yield target


@contextlib.contextmanager
def image_root(podman: Podman, image: str, target: Path, binds: dict[str, Path]) -> Iterator[Path]:
    """The root filesystem of ``image`` (`podman image mount`) as read_only_tree mounts it."""
    merged = Path(podman("image", "mount", image).strip())
    try:
        with read_only_tree(merged, target, binds) as root:
            yield root
    finally:
        podman("image", "unmount", image)


@dataclass
class Traced:
    """A command chrooted into an image's root as a user, under strace."""

    strace: subprocess.Popen[bytes]
    trace: Path
    log: Path

    def child(self, pattern: str, deadline: float) -> tuple[int, str]:
        """The pid and command line of strace's child once it runs ``pattern``.

        The child is chroot, which execs the command (/bin/ratelimit, a shell script that
        execs python) in the same pid. strace also forks short-lived children of its own at
        startup (probing what ptrace supports), so each child is looked at until one runs
        the pattern, or strace exits, or the deadline passes.
        """
        children = Path(f"/proc/{self.strace.pid}/task/{self.strace.pid}/children")
        seen: dict[int, str] = {}
        while time.monotonic() < deadline and self.strace.poll() is None:
            with contextlib.suppress(OSError):
                for pid in map(int, children.read_text().split()):
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                    seen[pid] = cmdline.replace(b"\0", b" ").decode(errors="replace")
                    if re.search(pattern, seen[pid]):
                        return pid, seen[pid]
            time.sleep(0.02)
        raise AssertionError(f"no child ran {pattern!r} (saw {seen}):\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def write_attempts(self) -> list[str]:
        """Every traced syscall refused because the file system is read-only."""
        return [line for line in self.trace.read_text().splitlines() if "= -1 EROFS" in line]

    def stop(self, pid: int) -> int:
        """SIGTERM to ``pid`` (the traced server), as Kubernetes sends it; its exit status."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        try:
            return self.strace.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.strace.kill()
            self.strace.wait(timeout=10)
            raise AssertionError(f"no exit within 20 s of SIGTERM:\n{self.output()}") from None


@contextlib.contextmanager
def traced_chroot(
    strace: str, root: Path, user: int, command: list[str], env: dict[str, str], workdir: Path
) -> Iterator[Traced]:
    """``chroot --userspec=USER:USER ROOT COMMAND`` with exactly ``env``, under strace.

    strace follows every process and thread and logs the failed file-system calls (-Z) to
    a file; the command's stdout and stderr go to another. Killed on leaving if still up.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    trace, log = workdir / "strace.log", workdir / "output.log"
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    args = [
        strace, "-f", "--seccomp-bpf", "-Z", "-qq", "-e", f"trace={TRACED}", "-o", str(trace),
        chroot, f"--userspec={user}:{user}", str(root), *command,
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    traced = Traced(process, trace, log)
    try:
        yield traced
    finally:
        if process.poll() is None:
            children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
            with contextlib.suppress(OSError):
                for pid in children.read_text().split():
                    os.kill(int(pid), signal.SIGKILL)
            process.kill()
            process.wait(timeout=10)


def status_fields(pid: int) -> dict[str, str]:
    """/proc/PID/status as name -> value."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {name: value.strip() for name, _, value in (line.partition(":") for line in lines)}


def mounts_seen_by(pid: int) -> dict[str, tuple[str, set[str]]]:
    """The mounts process ``pid`` sees, by mount point relative to its root: (type, options).

    /proc/PID/mountinfo lists mount points as the process sees them, from its own root
    (a chroot's); mounts outside that root are not listed.
    """
    seen = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        dash = fields.index("-")
        seen[fields[4]] = (fields[dash + 1], set(fields[5].split(",")))
    return seen
